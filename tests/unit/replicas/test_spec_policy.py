"""The drafting policy: draft where it measured more tokens per second, re-check the other
choice every `explore_every`-th step, learn per batch-size bucket, cap each request's chain at
what it recently kept. Time is a fake clock here (tests never time things): the engine's
forward advances it by a cost the test sets, so a verify can be made cheap or dear."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from sessionserve.replicas.speculative.draft_state import SourceRecord
from sessionserve.replicas.speculative.policy import MAX_DRAFT_FLOOR, SpecPolicy, bucket
from sessionserve.replicas.step import Drafts
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, mimic_drafter, random_drafter, tiny_engine, tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32)] == [1, 1, 2, 2, 3, 3, 4, 5, 6]


def _serve(policy: SpecPolicy, decisions: int, step_s, tokens, num_decodes: int = 8) -> list:
    """`decisions` steps as the policy picks them: a step's seconds are `step_s(i, drafted)`
    and its tokens (over all `num_decodes` requests) `tokens(i, drafted)`."""
    picks = []
    for i in range(decisions):
        drafted = policy.choose(num_decodes)
        picks.append(drafted)
        policy.observe(num_decodes, drafted, tokens(i, drafted), step_s(i, drafted))
    return picks


def test_the_faster_arm_wins_and_the_slower_is_rechecked() -> None:
    policy = SpecPolicy(explore_every=4, warmup_steps=2, explore_loss=0.05)
    assert policy.choose(8) is True  # a bucket tries drafting first ...
    policy.observe(8, True, tokens=8, seconds=1.0)
    policy.observe(8, True, tokens=8, seconds=1.0)
    assert policy.choose(8) is False  # ... then not drafting
    policy.observe(8, False, tokens=8, seconds=0.9)  # paired with the drafting steps before
    policy.observe(8, False, tokens=8, seconds=0.9)
    picks = [policy.choose(9) for _ in range(8)]  # 9 shares 8's bucket
    # plain is 10% faster: re-checked every max(4, 0.1 / 0.05) = 4th decision
    assert picks == [False, False, False, True] * 2
    # drafting steps turn out to last twice a plain one, for the same tokens: the cost ratio
    # follows from the re-checks, and drafting is re-checked every 0.5 * 2 / 0.05 = 20th
    picks = _serve(policy, 800, lambda i, d: 2.0 if d else 1.0, lambda i, d: 8)
    bucket = policy.bucket(8)
    assert bucket.cost_ratio == pytest.approx(2.0, rel=0.01)
    assert bucket.speed_ratio() == pytest.approx(0.5, rel=0.01)
    assert policy.recheck_every(bucket) == 20
    drafted = [i for i, p in enumerate(picks[-100:]) if p]
    assert len(drafted) == 5 and {
        b - a for a, b in zip(drafted[:-1], drafted[1:], strict=True)
    } == {20}
    assert policy.choose(1) is True  # another bucket learns for itself
    # drafting turns out to yield twice the tokens of a plain step in 1.2 of its time: the
    # re-checks find it and drafting becomes the choice; plain is re-checked every
    # (1 - 1.2 / 2) * (1.0 / 1.2) / 0.05 = 7th decision
    picks = _serve(policy, 800, lambda i, d: 1.2 if d else 1.0, lambda i, d: 16 if d else 8)
    assert policy.recheck_every(bucket) == 7
    assert 85 <= sum(picks[-100:]) <= 86
    summary = policy.summary()["8"]  # per decoding request at the machine's speed now
    assert summary["cost_ratio"] == pytest.approx(1.2, rel=0.02)
    assert summary["spec_request_tokens_per_s"] == pytest.approx(2 / 1.2, rel=0.05)
    assert summary["plain_request_tokens_per_s"] == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("drafting_cost, drafting_wins", [(1.2, True), (1.8, False)])
def test_the_choice_holds_while_the_machine_changes_speed(
    drafting_cost: float, drafting_wins: bool
) -> None:
    """A shared machine's speed drifts: here every step takes 2.5x as long for 40 steps in
    every 100 (on a 2-core VM plain steps went from 14 to 29 ms within one run). A drafting
    step yields 1.5 tokens a request on average (1 to 3) and costs `drafting_cost` plain
    steps at the same moment: 1.25x faster at 1.2, 0.83x at 1.8. The re-checked arm is
    compared with its neighbours, so the choice is right >= 90% of the time either way
    (compared by their own running means, measured at different speeds, the arms read
    drafting 0.7x at one request where it measured 1.2x in neighbouring steps)."""
    policy, rng = SpecPolicy(), random.Random(0)
    slow = lambda i: 2.5 if i % 100 >= 60 else 1.0  # noqa: E731
    picks = _serve(
        policy,
        3000,
        lambda i, d: 0.02 * slow(i) * (drafting_cost if d else 1.0),
        lambda i, d: rng.choice([1, 1, 2, 1, 3, 1]) if d else 1,  # a verify's yield varies
        num_decodes=1,
    )
    share = sum(picks[100:]) / len(picks[100:])
    assert share >= 0.9 if drafting_wins else share <= 0.1
    speed = policy.bucket(1).speed_ratio()  # (a re-check just after a change pairs across it)
    assert speed == pytest.approx(1.5 / drafting_cost, rel=0.2) and (speed > 1) == drafting_wins


def test_arms_compare_tokens_per_request_across_a_buckets_batch_sizes() -> None:
    """A bucket spans batch sizes, and a turn's tail shrinks through it: drafting steps
    measured at 7 requests (1.3 tokens a request in 42 ms: 217 tokens/s a step, 31 a request)
    and plain steps at 4 (1 token in 28 ms: 143 a step, 36 a request) must not make drafting
    look faster because its steps had more requests."""
    policy = SpecPolicy(explore_every=4, warmup_steps=2)
    for _ in range(2):
        policy.observe(7, True, tokens=9, seconds=0.042)
        policy.observe(4, False, tokens=4, seconds=0.028)
    assert policy.choose(5) is False
    arms = policy.summary()["4"]
    assert arms["plain_request_tokens_per_s"] > arms["spec_request_tokens_per_s"]


def test_a_recheck_in_long_steps_comes_more_rarely() -> None:
    """A verify step that yields half the tokens/s of a plain step but lasts 2.5 of them
    loses 1.25 plain steps each time it is re-checked: for ~1% of throughput, every 125th
    decision (a tokens/s gap alone would say every 50th, costing 2.5%)."""
    policy = SpecPolicy(explore_every=16, warmup_steps=1, explore_loss=0.01)
    policy.observe(8, True, tokens=10, seconds=0.25)  # 40 tokens/s in 250 ms steps
    policy.observe(8, False, tokens=8, seconds=0.1)  # 80 tokens/s in 100 ms steps
    picks = [policy.choose(8) for _ in range(250)]
    assert [i for i, p in enumerate(picks, start=1) if p] == [125, 250]
    assert policy.recheck_every(policy.bucket(8)) == 125
    policy.observe(8, True, tokens=20, seconds=0.1)  # drafting got fast: the arms trade places
    policy.observe(8, True, tokens=20, seconds=0.1)
    assert policy.choose(8) is True


def test_a_dear_recheck_waits_past_the_decision_cap_up_to_a_time_bound() -> None:
    """A re-check of drafting that pays 130 ms of put-off work beside 50 ms plain steps costs
    ~2.95 plain steps: for ~1% of throughput it waits 295 decisions, past the 128-decision cap,
    since 295 plain steps last 14.8 s, under `max_explore_s` (30 s); with a time bound of 0 the
    decision cap holds; with 5 s, 100 steps of 50 ms are too few and the cap's 128 hold."""

    def recheck_every(max_explore_s: float) -> int:
        policy = SpecPolicy(explore_every=16, warmup_steps=1, max_explore_s=max_explore_s)
        policy.observe(32, True, tokens=40, seconds=0.08)  # 500 tokens/s in 80 ms steps
        policy.observe(32, False, tokens=32, seconds=0.05)  # 640 tokens/s in 50 ms steps
        policy.observe_switch(1300, 0.13)  # the head's pass: 0.1 ms a position
        picks = [policy.choose(32, owed_positions=1300) for _ in range(300)]
        every = policy.recheck_every(policy.bucket(32), 0.13)
        assert [i for i, p in enumerate(picks, start=1) if p][:1] == [every]
        return every

    assert recheck_every(30.0) == 295  # (0.219 * 0.08 + 0.13) / 0.05 / 0.01
    assert recheck_every(0.0) == 128
    assert recheck_every(5.0) == 128


def _choices(policy: SpecPolicy, num_decodes: int, steps: int, owed_per_step: int) -> list[bool]:
    """The policy's choices over `steps` decisions, each plain step putting the head's pass
    over `owed_per_step` more positions off, each drafting step paying what was owed."""
    owed, picks = 0, []
    for _ in range(steps):
        picks.append(policy.choose(num_decodes, owed_positions=owed))
        owed = 0 if picks[-1] else owed + owed_per_step
    return picks


def test_drafting_is_taken_up_again_only_where_it_pays_for_the_deferred_pass() -> None:
    """Requests that did not draft owe the head their put-off positions, priced at what its
    passes cost a position when drafting was taken up before (`observe_switch`): drafting
    resumes where its gain over `explore_every` steps pays that back; a re-check of drafting
    counts it in its cost; once paid, drafting goes on."""

    def policy_owing(pass_s: float) -> SpecPolicy:
        policy = SpecPolicy(explore_every=10, warmup_steps=1, explore_loss=0.01, max_explore_s=0.0)
        policy.observe(8, True, tokens=21, seconds=0.2)  # 105 tokens/s
        policy.observe(8, False, tokens=20, seconds=0.2)  # 100 tokens/s
        policy.observe_switch(100, pass_s)  # a pass over 100 positions took `pass_s`
        return policy

    # drafting is 5% faster: plain is re-checked at the 10th decision; after it, taking
    # drafting up again owes >= 1 s (100 positions) for a gain of (1 - 100 / 105) * 0.2 s * 10
    # = 0.095 s, so plain stays, and drafting is re-checked every (0.0476 * 0.2 + 1) / 0.2 /
    # 0.01 -> 128 (the cap) decisions; that re-check paid the pass, so drafting goes on after it
    policy = policy_owing(1.0)
    picks = _choices(policy, 8, 145, owed_per_step=100)
    assert [i for i, p in enumerate(picks, start=1) if not p] == list(range(10, 138))
    # the pass costs 0.05 s: the gain pays it back, drafting resumes at once
    policy = policy_owing(0.05)
    assert _choices(policy, 9, 15, owed_per_step=100) == [True] * 9 + [False] + [True] * 5


def test_taking_drafting_up_is_priced_by_what_is_owed_now() -> None:
    """What drafting owes is what the decoding requests put off, whatever happened before: a
    batch's tail whose requests each owe a whole turn stays plain where drafting's small gain
    would not pay the pass back; the same arms with a few positions owed draft; nothing owed,
    they draft."""
    policy = SpecPolicy(explore_every=10, warmup_steps=1, explore_loss=0.01)
    policy.observe(4, True, tokens=21, seconds=0.2)  # 4-7 requests: drafting 5% faster
    policy.observe(4, False, tokens=20, seconds=0.2)
    policy.observe_switch(1000, 0.5)  # the head: 0.5 ms a position
    gain_s = (1 - 20 / 21) * 0.2 * 10  # 0.095 s over `explore_every` drafting steps
    assert policy.owed_s(1200) == pytest.approx(0.6) and policy.owed_s(1200) > gain_s
    assert policy.choose(5, owed_positions=1200) is False  # 5 requests owing ~240 each
    assert policy.choose(5, owed_positions=100) is True  # 0.05 s: paid back
    assert policy.choose(5, owed_positions=0) is True
    policy.observe_switch(100, 3.0)  # passes turn out dearer: owed positions weigh more
    assert policy.owed_s(100) > 0.05
    assert policy.choose(5, owed_positions=100) is False


def test_a_backlog_is_priced_by_what_each_position_adds_to_a_pass() -> None:
    """A head pass has a fixed cost (one forward, its next guess) and a cost per position.
    Most passes that take drafting up cover a few positions; priced by their ratio, a
    200-position backlog would cost 200 * 0.67 ms. With some passes of 200 positions among
    them the slope shows each position adds 0.03 ms: 6 ms; where every pass seen was of one
    size, the ratio (an upper bound) stands in."""
    policy = SpecPolicy()
    for _ in range(10):
        policy.observe_switch(3, 0.00209)  # 2 ms fixed + 0.03 ms a position
    assert policy.owed_s(200) == pytest.approx(200 * 0.00209 / 3)  # one size: the ratio
    for _ in range(3):
        policy.observe_switch(200, 0.008)
        policy.observe_switch(3, 0.00209)
        policy.observe_switch(3, 0.00209)
    assert policy.owed_s(200) == pytest.approx(0.006, rel=0.01)
    assert policy.owed_s(0) == 0.0


class FakeClock:
    """Advanced by the engine's forward: `plain` per step without drafts, `verify` with.
    Under overlap scheduling each step runs when it is submitted (still landing after the next
    one is scheduled), so the clock moves in one thread's order, the same in every run."""

    def __init__(self, engine, plain: float, verify: float) -> None:
        self.now = 0.0
        self.plain, self.verify = plain, verify  # a test may change them mid-run
        run = engine.runner.run_prepared
        if engine.forwards is not None:
            engine.forwards.submit = _run_at_once(engine.runner)

        def timed(batch, fb, layout, **kwargs):
            self.now += self.verify if any(s.num_drafts for s in batch.seqs) else self.plain
            return run(batch, fb, layout, **kwargs)

        engine.runner.run_prepared = timed
        engine.speculative.policy.clock = lambda: self.now


def _run_at_once(runner):
    def submit(batch, fb, layout) -> Future:
        done: Future = Future()
        done.set_result(runner.run_prepared(batch, fb, layout))
        return done

    return submit


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(5, 250, (12 + 7 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("verify_cost", [8.0, 1.2])
def test_the_engine_drafts_only_where_it_pays(verify_cost: float, overlap: bool) -> None:
    """A verify costing 8 plain steps never pays (a whole chain yields 5 tokens): after the
    warm-up, only the re-checks draft. At 1.2 it pays: nearly every step drafts. Greedy
    output equals transformers' either way. Under overlap scheduling the plain steps overlap
    (and are timed between their ends), and a re-check chosen while a step was in flight
    still drafts on the step after it."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, adaptive=True, overlap=overlap)
    FakeClock(engine, plain=1.0, verify=verify_cost)
    engine.speculative.policy.max_explore_every = 16  # a few re-checks within the answer
    engine.speculative.policy.max_explore_s = 0.0  # (the cap in decisions alone)
    (prompt,) = _prompts(1)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    (r,) = engine.generate([prompt], params)
    assert r.output_ids == hf_greedy(model, prompt, params.max_tokens)
    arms = engine.speculative.policy.summary()["1"]
    decode_steps = arms["spec_steps"] + arms["plain_steps"]
    if verify_cost > 5:
        assert arms["spec_request_tokens_per_s"] < arms["plain_request_tokens_per_s"]
        # 2 warm-up steps, then at most every 16th decision; and re-checks did draft
        assert 4 <= arms["spec_steps"] <= 2 + decode_steps // 16 + 1
        if overlap:
            assert engine.overlap_totals["overlapped_steps"] > arms["plain_steps"] // 2
    else:
        assert arms["spec_request_tokens_per_s"] > arms["plain_request_tokens_per_s"]
        assert arms["plain_steps"] <= 2 + decode_steps // 16 + 1
        assert r.spec_accepted > 0


def test_plain_rechecks_between_drafting_steps_are_timed() -> None:
    """While drafting leads, a plain re-check between drafting steps pays the head's pass over
    the step before it (those positions waited, since the re-check does not draft). Timed
    without that pass, it still updates plain's figure: when plain steps get cheaper, the
    re-checks find it (each a sample of what a drafting step costs over a plain one, in a
    running mean) and drafting stops. (Excluded, as such steps once were, plain's
    figure stayed the warm-up's for good, and the engine drafted where it lost.)"""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, adaptive=True)
    clock = FakeClock(engine, plain=1.0, verify=1.2)
    policy = engine.speculative.policy
    policy.max_explore_every = 16  # a few re-checks within the answer
    policy.max_explore_s = 0.0  # (the cap in decisions alone)
    first, second = _prompts(2)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine.generate([first], params)
    arms = policy.summary()["1"]
    assert arms["spec_request_tokens_per_s"] > arms["plain_request_tokens_per_s"]
    assert arms["plain_steps"] > 2  # the re-checks were timed, not only the warm-up's two
    assert arms["cost_ratio"] == pytest.approx(1.2)
    clock.plain = 0.1  # plain decoding gets 10x cheaper: a drafting step costs 12 plain ones
    longer = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    (r,) = engine.generate([second], longer)
    assert r.output_ids == hf_greedy(model, second, longer.max_tokens)
    before, arms = arms, policy.summary()["1"]
    assert arms["plain_request_tokens_per_s"] > arms["spec_request_tokens_per_s"]
    assert arms["cost_ratio"] > 6 and arms["speed_ratio"] < 1
    assert arms["plain_steps"] > before["plain_steps"] + 100  # and the answer went on plain


def test_a_step_that_pays_for_deferred_catch_up_is_not_timed() -> None:
    """While drafting is off the head's catch-up waits; the re-check that resumes it pays
    for every position since. That work is not counted as the step's (one prompt's pass
    would make drafting look several times dearer once it runs): here a deferred position
    costs 100 plain steps, and no timed step shows it. It is what taking drafting up again
    costs (`observe_switch`), which spaces the re-checks out, as far as the cap (16) allows."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, adaptive=True)
    clock = FakeClock(engine, plain=1.0, verify=8.0)
    spec = engine.speculative
    spec.policy.max_explore_every = 16  # a few re-checks within the answer
    spec.policy.max_explore_s = 0.0  # (the cap in decisions alone)
    eagle_catch_up, paid, timed = spec.eagle.catch_up, [], []

    def dear_catch_up(entries):
        owed = sum(max(0, e.end - e.start - 5) for e in entries)  # a verify commits <= 5
        clock.now += 100.0 * owed
        paid.append(owed)
        eagle_catch_up(entries)

    policy_observe = spec.policy.observe

    def observe(num_decodes, speculated, tokens, seconds, *head):
        timed.append(seconds)
        policy_observe(num_decodes, speculated, tokens, seconds, *head)

    spec.eagle.catch_up, spec.policy.observe = dear_catch_up, observe
    (prompt,) = _prompts(1)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    (r,) = engine.generate([prompt], params)
    assert r.output_ids == hf_greedy(model, prompt, params.max_tokens)
    assert sum(1 for owed in paid if owed > 0) >= 3  # re-checks (and the end) paid debts
    assert timed and max(timed) < 100.0
    assert spec.policy.owed_s(10) >= 500.0  # >= 50 plain steps a put-off position
    assert spec.policy.recheck_every(spec.policy.bucket(1), spec.policy.owed_s(10)) == 16
    arms = spec.policy.summary()["1"]
    assert arms["spec_steps"] >= 2
    assert arms["plain_request_tokens_per_s"] > arms["spec_request_tokens_per_s"]


def test_a_drafting_step_whose_head_pass_waits_is_priced_as_if_it_ran() -> None:
    """A drafting step followed by a plain one puts its head pass off (the plain step needs
    no guess), so its time lacks that pass; a re-check of drafting between plain steps would
    look cheaper than drafting is. The policy adds what the pass cost on drafting steps that
    ran it: here a verify costs 1.2 and the head's pass 0.5, and every timed drafting step,
    its pass run or put off, counts 1.7."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, adaptive=True)
    clock = FakeClock(engine, plain=1.0, verify=1.2)
    spec = engine.speculative
    eagle_catch_up, observed = spec.eagle.catch_up, []

    def dear_catch_up(entries):
        clock.now += 0.5 if entries else 0.0
        eagle_catch_up(entries)

    policy_observe = spec.policy.observe

    def observe(num_decodes, speculated, tokens, seconds, *head):
        observed.append((speculated, seconds, *head))
        policy_observe(num_decodes, speculated, tokens, seconds, *head)

    picks = iter([True] * 6 + [False, True] * 50)  # steady drafting, then re-checks between
    spec.eagle.catch_up, spec.policy.observe = dear_catch_up, observe
    spec.policy.choose = lambda num_decodes, owed_positions=0: next(picks, False)
    (prompt,) = _prompts(1)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    (r,) = engine.generate([prompt], params)
    assert r.output_ids == hf_greedy(model, prompt, params.max_tokens)
    drafting = [o for o in observed if o[0]]
    ran = [o for o in drafting if o[4] == 0]  # (speculated, seconds, head_s, covered, put off)
    waited = [o for o in drafting if o[4] > 0]
    assert len(ran) >= 3 and len(waited) >= 10
    assert all(o[1] == pytest.approx(1.7) and o[2] == pytest.approx(0.5) for o in ran)
    assert all(o[1] == pytest.approx(1.2) and o[3] == 0 for o in waited)  # as timed ...
    on = spec.policy.bucket(1).on  # ... and as the policy counts them
    assert [s.seconds for s in on.recent] == pytest.approx([1.7] * len(on.recent))
    assert [s for plain, s, *_ in observed if not plain][-5:] == pytest.approx([1.0] * 5)


@pytest.mark.parametrize("drafting", [False, True])
def test_the_decoder_tells_the_policy_what_the_requests_owe_the_head(drafting: bool) -> None:
    """Each decision gets the positions whose head pass the decoding requests put off: while
    drafting stays off, the prompt's and every decoded token's since (none before the first
    decision); while it stays on, none. The strict memory check runs after every step."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(model, drafter=mimic_drafter, adaptive=True)
    asked: list[tuple[int, int]] = []

    def choose(num_decodes: int, owed_positions: int = 0) -> bool:
        asked.append((num_decodes, owed_positions))
        return drafting

    engine.speculative.policy.choose = choose
    (prompt,) = _prompts(1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (r,) = engine.generate([prompt], params)
    assert r.output_ids == hf_greedy(model, prompt, params.max_tokens)
    decisions = [owed for n, owed in asked if n == 1]  # the last, with nothing left, asks (0, 0)
    assert len(decisions) >= 3
    if drafting:
        assert decisions == [0] * len(decisions)
    else:  # the prompt's pass waits from the first step on, then one position a step
        assert decisions == [0] + [len(prompt) + i for i in range(len(decisions) - 1)]


def test_an_unsure_heads_chains_stop_after_one_draft() -> None:
    """An untrained head is nearly always wrong, and unsure: its drafts' probabilities are
    far below the default `min_draft_confidence`, so with the policy on (and verifies as
    cheap as plain steps, so drafting stays on) every chain stops after its first draft."""
    model = tiny_model(seed=5)
    engine = tiny_engine(
        model, drafter=random_drafter, num_drafts=4, adaptive=True, min_draft_confidence=0.1
    )
    FakeClock(engine, plain=1.0, verify=1.0)
    prompts = _prompts(2)
    for prompt, r in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        assert r.spec_steps > 8
    stats = engine.spec_stats
    assert stats.drafted == stats.steps, stats


def test_a_source_record_reads_a_chain_draft_by_draft() -> None:
    """A verify judges a chain's drafts in order up to the first rejected one: chains kept
    whole or not at all read as likely to the end (half their drafts kept on average), a
    chain whose second draft always fails reads as worth one draft."""
    whole = SourceRecord()
    whole.observe(3, 3)  # the first kept, and the two after it, each after a kept one
    assert (whole.first_kept, whole.next_kept, whole.next_tried) == (1, 2, 2)
    for _ in range(8):
        whole.observe(4, 4)
        whole.observe(4, 0)  # the first rejected: nothing after it was judged
    assert 0.4 < whole.first < 0.6 and whole.then > 0.9
    assert whole.likely_len(4, 0.1) == 4
    assert whole.expected(4) > 1.6  # the old per-draft rate (0.5) said 0.94
    second_fails = SourceRecord()
    for _ in range(10):
        second_fails.observe(2, 1)
    assert second_fails.first > 0.9 and second_fails.then < 0.1
    assert second_fails.likely_len(4, 0.1) == 1
    assert second_fails.likely_len(4, 0.0) == 4


def _scripted_history(engine, prompt: list[int], answer: list[int], wrong: Callable) -> list:
    """History drafts from a script: the answer's true next 4 tokens, with draft j of the
    request's v-th verify made wrong where `wrong(v, j)`; returns each verify's chain length."""
    history, lengths = engine.speculative.history, []
    vocab = history.vocab_size

    def draft_len(req, limit: int) -> int:
        at = req.num_tokens - len(prompt)  # the answer's index of the first draft
        true = answer[at : at + min(4, limit - req.num_tokens)]
        v = len(lengths)
        req.drafting.history_tokens = [
            (t + 1) % vocab if wrong(v, j) else t for j, t in enumerate(true)
        ]
        return len(true)

    def propose(req, length: int):
        lengths.append(length)
        return Drafts(req.drafting.history_tokens[:length], None)

    history.draft_len, history.propose = draft_len, propose
    return lengths


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_history_chains_stop_where_their_second_draft_keeps_failing(floor: float) -> None:
    """History drafts have no probability to stop by: with the policy on, a request's chain
    stops where its record says a draft is less likely to be kept than
    `min_draft_confidence`. Here every first draft is right and every second wrong: with the
    default floor the chains come down to one draft after the first verify, and stay there:
    the record goes on judging the whole chains offered against the tokens made, so it
    needs no longer verifies to see the second drafts still fail (fed by verifies alone, it
    tried a second draft again each time the evidence against it had faded); with none they
    stay four long (capped at what verifies kept on average plus one, as before, they stayed
    two long). The answer is the plain one either way."""
    model = tiny_model(seed=5)
    engine = tiny_engine(
        model, history_drafts=True, num_drafts=4, adaptive=True, min_draft_confidence=floor
    )
    FakeClock(engine, plain=1.0, verify=1.0)
    (prompt,) = _prompts(1)
    answer = hf_greedy(model, prompt, GREEDY.max_tokens)
    lengths = _scripted_history(engine, prompt, answer, lambda v, j: j >= 1)
    (r,) = engine.generate([prompt], GREEDY)
    assert r.output_ids == answer
    assert len(lengths) > 10
    if floor:
        assert lengths[0] == 4 and set(lengths[1:]) == {1}, lengths
    else:
        assert set(lengths[:-1]) == {4}, lengths


def test_history_chains_kept_all_or_nothing_stay_whole() -> None:
    """An answer that loops keeps a history chain whole or not at all; its drafts after a
    kept first one are always kept, so its chains stay four long with the policy on (capped
    at the drafts its verifies kept on average plus one, as before, they were cut to 3)."""
    model = tiny_model(seed=5)
    engine = tiny_engine(
        model, history_drafts=True, num_drafts=4, adaptive=True, min_draft_confidence=0.1
    )
    FakeClock(engine, plain=1.0, verify=1.0)
    (prompt,) = _prompts(1)
    answer = hf_greedy(model, prompt, GREEDY.max_tokens)
    lengths = _scripted_history(engine, prompt, answer, lambda v, j: v % 3 == 1)
    (r,) = engine.generate([prompt], GREEDY)
    assert r.output_ids == answer
    assert len(lengths) > 6
    assert set(lengths[:-1]) == {4}, lengths


def test_a_seeded_answer_does_not_depend_on_what_the_policy_measured() -> None:
    """Whether drafting pays is timing; a seeded sampled request drafts by its own record
    only, so the same seed gives the same answer whether verifies look cheap or dear."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    answers = []
    for verify_cost in (8.0, 1.0):
        engine = tiny_engine(model, drafter=mimic_drafter, history_drafts=True, adaptive=True)
        FakeClock(engine, plain=1.0, verify=verify_cost)
        greedy = engine.generate(prompts[:2], GREEDY)  # the policy learns on these
        assert [r.output_ids for r in greedy] == [hf_greedy(model, p, 40) for p in prompts[:2]]
        (r,) = engine.generate(prompts[2:], params)
        assert r.spec_steps > 0
        answers.append(r.output_ids)
    assert answers[0] == answers[1]


def _drafting_at(policy: SpecPolicy, num_decodes: int, fixed: float, per_draft: float) -> None:
    """400 decisions at `num_decodes` requests: a drafting step of d drafts per request lasts
    1 + `fixed` + `per_draft` x d plain steps, with 1/4 to 2 drafts per request."""
    rng = random.Random(0)
    for _ in range(400):
        drafted = policy.choose(num_decodes)
        drafts = rng.choice([num_decodes // 4, num_decodes, 2 * num_decodes]) if drafted else 0
        extra = fixed + per_draft * drafts / num_decodes if drafted else 0.0
        policy.observe(num_decodes, drafted, num_decodes + drafts // 2, 1.0 + extra, drafts=drafts)


def test_a_drafts_cost_is_read_per_draft_from_paired_steps() -> None:
    """At 32 requests each draft costs 0.6 of a request's row, with 8 to 64 drafts a step:
    the cost ratio of whole steps swings from 1.15 to 2.2, what one draft costs reads 0.6
    throughout, and that is the floor a draft's chance of being kept must reach there. A
    bucket never observed, or before three pairs, has no floor."""
    policy = SpecPolicy(explore_every=4, warmup_steps=2, explore_loss=0.05)
    assert policy.draft_floor(32) is None
    _drafting_at(policy, 32, fixed=0.0, per_draft=0.6)
    assert len(policy.bucket(32).pairs) >= 3
    assert policy.draft_floor(32) == pytest.approx(0.6, abs=0.01)
    assert policy.draft_floor(4) is None  # learnt per bucket
    assert policy.summary()["32"]["draft_cost"] == pytest.approx(0.6, abs=0.01)


def test_what_a_drafting_step_costs_whatever_its_drafts_is_not_put_on_each_draft() -> None:
    """A drafting step that costs 0.3 of a plain step for drafting at all (another compiled
    package) and 0.2 of a row a draft: the floor is the 0.2 a draft adds, not the ~0.5 a
    draft's share of the whole extra cost reads; with every step drafting one per request
    there is no slope to read, and the share stands in."""
    policy = SpecPolicy(explore_every=4, warmup_steps=2, explore_loss=0.05)
    _drafting_at(policy, 8, fixed=0.3, per_draft=0.2)
    assert policy.draft_floor(8) == pytest.approx(0.2, abs=0.01)
    same = SpecPolicy(explore_every=4, warmup_steps=2, explore_loss=0.05)
    for _ in range(400):
        drafted = same.choose(8)
        same.observe(8, drafted, 8, 1.5 if drafted else 1.0, drafts=8 if drafted else 0)
    assert same.draft_floor(8) == pytest.approx(0.5, abs=0.01)


def test_the_floor_stops_short_of_chains_kept_nearly_always() -> None:
    """A draft costing more than a row would never pay, but the floor stops at
    `MAX_DRAFT_FLOOR`: chains kept nearly always (an agent copying a file) still draft, and
    their steps go on measuring what a draft costs."""
    policy = SpecPolicy(explore_every=4, warmup_steps=2)
    _drafting_at(policy, 8, fixed=0.0, per_draft=1.5)
    assert policy.bucket(8).draft_cost == pytest.approx(1.5, abs=0.01)
    assert policy.draft_floor(8) == MAX_DRAFT_FLOOR
    copying, unsure = SourceRecord(), SourceRecord()
    for _ in range(50):
        copying.observe(4, 4)
        unsure.observe(4, 4)
        unsure.observe(4, 0)
    assert copying.likely_len(4, MAX_DRAFT_FLOOR) == 4
    assert unsure.likely_len(4, MAX_DRAFT_FLOOR) == 0


@pytest.mark.parametrize("floor", [None, 0.7])
def test_history_drafts_below_the_floor_wait_and_are_judged_by_the_target(floor) -> None:
    """The policy's floor for drafts (what one costs at this batch size) stops a request from
    verifying history drafts whose chance of being kept is below it, its first draft too;
    the token the target makes where its first draft pointed then judges that draft, so the
    request takes drafting up again once its drafts are kept. Here the first drafts are wrong
    for the answer's first 15 tokens and right after: with a floor of 0.7 the request stops
    verifying after its first wrong verify and starts again once the target has kept its
    declined drafts for a few steps; with none it verifies at every step. The answer is the
    plain one either way, and the strict memory check runs after every step."""
    model = tiny_model(seed=5)
    engine = tiny_engine(
        model, history_drafts=True, num_drafts=4, adaptive=True, min_draft_confidence=0.0
    )
    FakeClock(engine, plain=1.0, verify=1.0)
    spec = engine.speculative
    spec.policy.choose = lambda num_decodes, owed_positions=0: True
    spec.policy.draft_floor = lambda num_decodes: floor
    (prompt,) = _prompts(1)
    answer = hf_greedy(model, prompt, GREEDY.max_tokens)
    history, verified = spec.history, []  # the answer's index of each verify's first draft

    def draft_len(req, limit: int) -> int:
        at = req.num_tokens - len(prompt)
        true = answer[at : at + min(4, limit - req.num_tokens)]
        wrong = at < 15
        req.drafting.history_tokens = [(t + 1) % history.vocab_size if wrong else t for t in true]
        return len(true)

    def propose(req, length: int):
        verified.append(req.num_tokens - len(prompt))
        return Drafts(req.drafting.history_tokens[:length], None)

    history.draft_len, history.propose = draft_len, propose
    (r,) = engine.generate([prompt], GREEDY)
    assert r.output_ids == answer
    early = [at for at in verified if at < 15]
    if floor is None:
        assert early == list(range(1, 15)), verified  # every step, each keeping nothing
    else:
        assert early == [1], verified  # one wrong verify, then none while they stay wrong
        later = [at for at in verified if at >= 15]
        assert later and later[0] <= 35, verified  # taken up again after a few right ones
        assert engine.spec_stats.accepted > 0


def test_a_source_its_floor_declines_leaves_the_request_to_the_head() -> None:
    """A history chain whose drafts are too unlikely to be kept (here always wrong, against
    `min_draft_confidence` 0.5) is declined; where its record still promises more than the
    head's (as an all-or-nothing record does: half its chains kept whole is two drafts of four
    expected, at a first-draft chance of 0.5), the head drafts instead of nobody. The answer is
    the plain one and the strict memory check runs after every step."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    engine = tiny_engine(
        model, drafter=mimic_drafter, history_drafts=True, adaptive=True, min_draft_confidence=0.5
    )
    spec = engine.speculative
    spec.policy.choose = lambda num_decodes, owed_positions=0: True
    spec._expected = lambda req, source, n: 2.0 if source == "history" else 1.0
    history, verified = spec.history, {"history": 0, "eagle": 0}

    def draft_len(req, limit: int) -> int:
        req.drafting.history_tokens = [5, 6, 7, 8]  # never what the target makes
        return min(4, limit - req.num_tokens)

    def propose(req, length: int):
        return Drafts(req.drafting.history_tokens[:length], None)

    history.draft_len, history.propose = draft_len, propose
    verify = spec._verify

    def counted(s, chain, out, best):
        verified[s.req.drafting.source] += 1
        return verify(s, chain, out, best)

    spec._verify = counted
    (prompt,) = _prompts(1)
    (r,) = engine.generate([prompt], GREEDY)
    assert r.output_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert verified["history"] == 1  # its first chain, before its record said anything
    assert verified["eagle"] >= GREEDY.max_tokens // 5, verified  # the head drafted instead
    assert spec.by_source["eagle"].accepted > 0


def test_a_seeded_answer_does_not_depend_on_the_measured_floor() -> None:
    """The floor a draft must reach is measured from timings, so it must not cut a seeded
    sampled request's history chains: how many drafts it verifies changes which random
    numbers its answer draws. With floors of 0 and 0.9 it verifies the same chains (here
    always offered, never kept) and gives the same answer; before, at 0.9 it verified one
    and answered otherwise."""
    model = tiny_model(seed=5)
    prompt = [7, 8, 9, 10, 11] * 6
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=11, ignore_eos=True)
    runs = []
    for floor in (0.0, 0.9):
        engine = tiny_engine(
            model, history_drafts=True, num_drafts=4, adaptive=True, min_draft_confidence=0.0
        )
        spec = engine.speculative
        spec.policy.choose = lambda num_decodes, owed_positions=0: True
        spec.policy.draft_floor = lambda num_decodes, floor=floor: floor

        def draft_len(req, limit: int) -> int:
            req.drafting.history_tokens = [5, 6, 7, 8]
            return min(4, limit - req.num_tokens)

        spec.history.draft_len = draft_len
        (r,) = engine.generate([prompt], params)
        runs.append((r.output_ids, r.spec_steps))
    assert runs[0] == runs[1]
    assert runs[0][1] >= 50  # (every step but the last few verified its chain)
