"""Rejection sampling keeps the target's distribution: chi-square goodness-of-fit tests.

Seeds are fixed, so each test is deterministic; the significance level is ALPHA = 0.01 (a
correct implementation fails with probability 1% over seeds; a biased one, e.g. one that keeps
every draft, fails these by many orders of magnitude).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sessionserve.replicas.speculative.acceptance import accept_sampled
from sessionserve.wire import SamplingParams
from tests.models import mimic_drafter, tiny_engine, tiny_model

ALPHA = 0.01


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; categories expecting < 5 counts are pooled into one."""
    n = observed.sum()
    expected = expected_probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # pool too small to stand alone: fold it into the smallest category
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmin()] += observed[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(exp) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_accept_sampled_emits_tokens_distributed_as_the_target() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 8
    p = torch.rand(3, vocab, generator=gen).softmax(-1)
    p[0, 5] = 0.0  # a token the target's filters removed (top-k/top-p leave zeros)
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(2, vocab, generator=gen).pow(3)
    q = q / q.sum(-1, keepdim=True)  # a poor drafter, proposing token 5 too
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    rejected_first = 0
    for _ in range(20_000):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        v = accept_sampled(p, q, drafts, gen)
        first[v.tokens[0]] += 1
        if len(v.tokens) > 1:
            second[v.tokens[1]] += 1
        rejected_first += v.accepted == 0
    assert first[5] == 0
    assert chi_square_p_value(first, p[0]) > ALPHA
    assert chi_square_p_value(second, p[1]) > ALPHA
    assert 1_000 < rejected_first < 19_000  # both branches ran many times


def test_a_keep_every_draft_bug_would_be_caught() -> None:
    """The same test rejects tokens drawn from the drafter instead of the target."""
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(8, generator=gen).softmax(-1)
    q = torch.rand(8, generator=gen).pow(3)
    q = q / q.sum()
    biased = torch.bincount(torch.multinomial(q, 5_000, True, generator=gen), minlength=8)
    assert chi_square_p_value(biased.float(), p) < 1e-6


def _exact_marginals(model, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """P(token 1), P(token 2), P(token 3) of the target alone, summed over all paths."""
    vocab = model.config.vocab_size

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1].double()
        return (logits / temperature).softmax(-1)

    p1 = probs([prompt])[0]
    pairs = list(range(vocab))
    p2_given = probs([prompt + [a] for a in pairs])  # [V, V]
    p2 = (p1[:, None] * p2_given).sum(0)
    triples = list(itertools.product(pairs, pairs))
    p3_given = probs([prompt + [a, b] for a, b in triples]).view(vocab, vocab, vocab)
    p3 = (p1[:, None, None] * p2_given[:, :, None] * p3_given).sum((0, 1))
    return [p1, p2, p3]


@pytest.mark.parametrize("min_confidence", [0.0, 0.5])
def test_engine_speculative_sampling_matches_the_target_distribution(
    min_confidence: float,
) -> None:
    """Also with chains that stop where the drawn drafts' probability under the head falls
    (`min_draft_confidence`): the stop depends on the drafts alone, so the output is still
    distributed as the target's."""
    vocab, temperature, runs = 12, 1.0, 2_400
    model = tiny_model(num_hidden_layers=1, seed=11, vocab_size=vocab, init_std=0.2)
    engine = tiny_engine(
        model,
        drafter=lambda m: mimic_drafter(m, noise=0.15, seed=2),
        num_drafts=3,
        max_rows=64,
        min_draft_confidence=min_confidence,
    )
    prompt = [3, 7, 2, 9, 4]
    counts = torch.zeros(3, vocab)
    for batch in range(runs // 48):
        params = [
            SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True, seed=i)
            for i in range(batch * 48, (batch + 1) * 48)
        ]
        rids = [engine.submit(prompt, p) for p in params]
        engine.run_until_idle()
        for rid in rids:
            out = engine.take_result(rid).output_ids
            for pos, tok in enumerate(out):
                counts[pos, tok] += 1
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.drafted  # drafts both kept and rejected
    if min_confidence:  # chains of every length: some stopped early, some ran to 3
        assert stats.steps < stats.drafted < 3 * stats.steps, (stats.drafted, stats.steps)
    for pos, exact in enumerate(_exact_marginals(model, prompt, temperature)):
        assert counts[pos].sum() == runs
        p_value = chi_square_p_value(counts[pos], exact)
        assert p_value > ALPHA, (pos, p_value, counts[pos], exact)
