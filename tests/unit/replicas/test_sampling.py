"""Sampling: seeds, filters, penalties, stop conditions and logprobs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sessionserve.replicas import sampling, sampling_kernel
from sessionserve.replicas.sampling import (
    apply_penalties,
    draw,
    draw_rows,
    filter_logits,
    filtered_probs,
    greedy_tokens,
    sample,
    sample_on_device,
)
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import EOS, hf_greedy, tiny_engine, tiny_model

PROMPT = [5, 9, 13, 17, 21, 25]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_same_seed_same_output_whatever_the_batch(model) -> None:
    engine = tiny_engine(model)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    alone = engine.generate([PROMPT], p)[0].output_ids
    crowd = engine.generate(
        [PROMPT, PROMPT[:3], PROMPT * 2],
        SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True),
    )
    assert crowd[0].output_ids == alone
    other = engine.generate([PROMPT], p.model_copy(update={"seed": 12}))[0].output_ids
    assert other != alone


def test_unseeded_samples_differ_between_engines_unless_the_engine_is_seeded(model) -> None:
    """Replicas start alike, so with one fixed seed each would give a prompt's first unseeded
    sampled answer alike, and a restart would repeat them all (vLLM's default seed 0 did so
    on 8 GPUs, vllm-project/vllm#11953): by default each engine draws its own seed.
    `engine.seed` makes a fresh engine's unseeded samples repeat; a request's own seed fixes
    its tokens whatever the engine's."""
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    seeded = unseeded.model_copy(update={"seed": 5})

    def first_answers(engine) -> tuple[list[int], list[int]]:
        (a,) = engine.generate([PROMPT], unseeded)
        (b,) = engine.generate([PROMPT], seeded)
        return a.output_ids, b.output_ids

    default_a, default_b = first_answers(tiny_engine(model)), first_answers(tiny_engine(model))
    fixed_a, fixed_b = (
        first_answers(tiny_engine(model, seed=3)),
        first_answers(tiny_engine(model, seed=3)),
    )
    other = first_answers(tiny_engine(model, seed=4))
    assert default_a[0] != default_b[0]  # 16 tokens drawn at temperature 1 from ~256 ids
    assert fixed_a[0] == fixed_b[0] and other[0] != fixed_a[0]
    assert default_a[1] == default_b[1] == fixed_a[1] == other[1]


def test_top_k_one_is_greedy_and_greedy_matches_generate(model) -> None:
    engine = tiny_engine(model)
    want = hf_greedy(model, PROMPT, 10)
    k1 = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))
    assert k1[0].output_ids == want[: len(k1[0].output_ids)]


def test_filters_keep_what_they_should() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(top2).tolist() == [True, True, False, False, False]
    probs = logits.softmax(-1)  # [0.64, 0.24, 0.09, ...]
    nucleus = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(nucleus).tolist() == [True, True, False, False, False]
    minp = filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.isfinite(minp).tolist() == (probs >= 0.2 * probs.max()).tolist()
    hot = filter_logits(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, logits / 2)


def test_penalties() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0, 1], [])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = apply_penalties(
        logits.clone(), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [], [2, 2, 3]
    )
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]


def test_logprobs_are_the_models_distribution(model) -> None:
    engine = tiny_engine(model)
    r = engine.generate(
        [PROMPT],
        SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=5, ignore_eos=True),
    )[0]
    full = torch.tensor([PROMPT + r.output_ids])
    with torch.no_grad():
        ref_model = tiny_model()  # the same seed: the same weights, untouched attention
        lp = torch.log_softmax(ref_model(full).logits[0].float(), -1)
    for i, tl in enumerate(r.logprobs):
        row = lp[len(PROMPT) - 1 + i]
        assert abs(tl.logprob - float(row[tl.token_id])) < 1e-4
        assert [t for t, _ in tl.top] == row.topk(5).indices.tolist()
        assert tl.top[0][0] == tl.token_id  # greedy picks the top-1


def test_stop_strings_tokens_eos_and_ignore_eos(model) -> None:
    engine = tiny_engine(model)
    free = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    third = free.output_ids[2]
    by_string = engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(f"w{third}",))
    )[0]
    first = free.output_ids.index(third)
    assert by_string.finish_reason is FinishReason.STOP
    assert by_string.output_ids == free.output_ids[: first + 1]  # the stopping token is kept
    assert f"w{third}" not in by_string.text  # but its text is cut
    by_token = engine.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(third,)),
    )[0]
    assert by_token.output_ids == by_string.output_ids
    eos_model = tiny_model(seed=16)  # greedy from PROMPT emits EOS as its 14th token
    engine2 = tiny_engine(eos_model)
    want = hf_greedy(eos_model, PROMPT, 40)
    assert EOS in want
    r = engine2.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0))[0]
    assert r.finish_reason is FinishReason.STOP and r.output_ids == want[: want.index(EOS) + 1]
    ignoring = engine2.generate(
        [PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )[0]
    assert ignoring.finish_reason is FinishReason.LENGTH and len(ignoring.output_ids) == 40


def test_a_batch_comes_back_in_one_packed_copy_with_each_rows_logprobs() -> None:
    """`sample_on_device` packs the chosen ids and the logprob rows of the rows that asked
    (each with its own number of alternatives) into one vector; `to_host` unpacks it."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=3, logprobs=True, top_logprobs=0),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
    ]
    gens = [None, None, torch.Generator().manual_seed(3), None]
    on_device = sample_on_device(logits, params, [()] * 4, [()] * 4, gens)
    assert on_device.packed.dim() == 1 and on_device.rows == 4
    host = on_device.to_host()
    assert host.token_ids == on_device.tokens.tolist()
    greedy = logits.argmax(-1).tolist()
    assert [host.token_ids[i] for i in (0, 1, 3)] == [greedy[i] for i in (0, 1, 3)]
    lp = torch.log_softmax(logits, -1)
    assert host.logprobs is not None and host.logprobs[1] is None
    for i, n in ((0, 2), (2, 0), (3, 5)):
        got = host.logprobs[i]
        assert got.token_id == host.token_ids[i]
        assert got.logprob == pytest.approx(lp[i, got.token_id].item(), abs=1e-6)
        best = lp[i].topk(n) if n else None
        assert [t for t, _ in got.top] == (best.indices.tolist() if n else [])
    # the same draw as the plain `sample` (one seeded generator, rewound)
    gens[2] = torch.Generator().manual_seed(3)
    assert sample(logits, params, [()] * 4, [()] * 4, gens).token_ids == host.token_ids


def argmax_cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits whose argmax a shortcut could get wrong: many-way ties (the first wins), rows
    masked to -inf (a grammar's) or all -inf, +inf, NaN (the first wins, even past a +inf),
    rows shorter than a vector and longer than the kernel's parts (16,384), rows not packed
    together (a slice of wider rows)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for rows, vocab in [(1, 7), (3, 100), (8, 49152), (33, 1000), (2, 262144), (5, 16385)]:
        tied = torch.randint(0, 4, (rows, vocab), generator=gen).to(dtype)
        masked = tied.clone()
        masked[:, ::3] = float("-inf")
        nan = tied.clone()
        nan[0, vocab // 2] = float("nan")
        nan[0, -1] = float("inf")  # a NaN before a +inf
        nan[-1, -1] = float("nan")
        nan[-1, 0] = float("inf")  # and after one
        spread = torch.randn(rows, vocab + 3, generator=gen).to(dtype)
        spread[:, -1] = float("inf")
        cases += [tied, masked, torch.full((rows, vocab), float("-inf"), dtype=dtype), nan]
        cases += [spread, spread[:, 2:]]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_ties_masks_and_nan_included(dtype) -> None:
    """`greedy_tokens` replaces `argmax(-1)` on the hot path: the same index on every row,
    whichever way it computes them (the kernel where loaded: an engine on a CPU loads it)."""
    for logits in argmax_cases(dtype):
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_bf16_logits_sample_as_their_fp32_copy() -> None:
    """Greedy rows read bf16 logits as they are; penalised, sampled and logprob rows take them
    in fp32. Either way a step's tokens and logprobs are those of the logits' fp32 copy."""
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    logits[3] = logits[3] * 0.1
    logits[3, 7], logits[3, 8] = 1.0, 0.9  # token 7 is the top, and already in the output
    logits = logits.bfloat16()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_p=0.8, seed=6, logprobs=True),
    ]
    outputs = [(), (), (), (7,), ()]

    def run(x: torch.Tensor) -> Any:
        gens = [None, None, torch.Generator().manual_seed(5), None]
        gens.append(torch.Generator().manual_seed(6))
        return sample_on_device(x, params, outputs, outputs, gens).to_host()

    got, want = run(logits), run(logits.float())
    assert got.token_ids == want.token_ids
    assert got.token_ids[3] == 8  # the penalty moved the pick off the top
    assert got.logprobs == want.logprobs
    only_greedy = [SamplingParams(temperature=0)] * 5
    picks = sample_on_device(logits, only_greedy, [()] * 5, [()] * 5, [None] * 5).to_host()
    assert picks.token_ids == logits.float().argmax(-1).tolist()


def peaked_logits(rows: int, vocab: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A model's shape of logits: a few large values over a long flat tail (the nucleus of
    top_p 0.9 is a few tokens), rounded to `dtype` (bf16 rounds many of them into ties)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    head = torch.randint(0, vocab, (rows, 12), generator=gen)
    logits.scatter_(1, head, 12 + 3 * torch.rand(rows, 12, generator=gen))
    return logits.to(dtype)


FILTERS = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.8),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1),
]


def whole_vocabulary(logits: torch.Tensor, params, u: torch.Tensor) -> torch.Tensor:
    """The draw over the whole vocabulary: `filter_logits`, softmax, `draw`."""
    return draw(filter_logits(logits.float(), params).softmax(-1), u)


@pytest.fixture(params=["levels", "topk"])
def candidates(request, monkeypatch) -> str:
    """Which candidates top-k / top-p rows are filtered among: the sampling kernel's levels
    (`_level_kept`, where it loads) or their `topk` largest logits (without it)."""
    if request.param == "topk":
        monkeypatch.setattr(sampling_kernel, "takes_logits", lambda x: False)
    elif not sampling_kernel.load():
        pytest.skip(f"the sampling kernel cannot be built here: {sampling_kernel.KERNEL.why_not()}")
    return request.param


def spy_on_kept_among(monkeypatch) -> list[tuple[object, bool]]:
    """(what `_kept_among` returned, whether its candidates were a level's) for each call."""
    taken: list[tuple[object, bool]] = []
    kept_among = sampling._kept_among

    def spy(*args: Any) -> object:
        taken.append((kept_among(*args), len(args) > 5 and args[5]))
        return taken[-1][0]

    monkeypatch.setattr(sampling, "_kept_among", spy)
    return taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_and_top_p_rows_draw_among_their_candidates_as_over_all(
    dtype, candidates, monkeypatch
) -> None:
    """`draw_rows` filters top-k / top-p rows among their candidates where the kept set
    lies there: the same tokens as over the whole vocabulary for the same uniforms, and it
    took that path for every peaked row (a spy on `_kept_among`), from the kernel's levels
    where it is used."""
    taken = spy_on_kept_among(monkeypatch)
    for seed in range(12):
        logits = peaked_logits(6, 5000, seed, dtype)
        params = [FILTERS[(seed + r) % len(FILTERS)] for r in range(6)]
        u = torch.rand(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        got = draw_rows(logits, params, u)
        assert torch.equal(got, whole_vocabulary(logits, params, u))
    assert len(taken) == 72 and None not in [kept for kept, _ in taken]
    assert all(level == (candidates == "levels") for _, level in taken)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_probs_are_the_filtered_softmax_without_the_sort(
    dtype, candidates, monkeypatch
) -> None:
    """`filtered_probs` (speculative acceptance's target distribution) is
    `filter_logits(...).softmax(-1)`: the same kept tokens, probabilities within fp32
    rounding, for peaked rows (taken among the candidates: a spy counts them) and flat ones
    (the whole row, or a level of the kernel's)."""
    taken = spy_on_kept_among(monkeypatch)
    flat = torch.randn(2, 5000, generator=torch.Generator().manual_seed(9)).to(dtype) * 0.1
    for seed in range(6):
        logits = torch.cat([peaked_logits(4, 5000, seed, dtype), flat]).float()
        for p in FILTERS:
            want = filter_logits(logits, p).softmax(-1)
            got = filtered_probs(logits, p)
            assert torch.equal(got > 0, want > 0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        mixed = [FILTERS[(seed + r) % len(FILTERS)] for r in range(6)]
        got = filtered_probs(logits, mixed)
        want = filter_logits(logits, mixed).softmax(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    found = [kept for kept, _ in taken if kept is not None]
    # every peaked row by every filter (flat rows under a top-k alone may be taken as well)
    assert len(found) >= 6 * (len(FILTERS) + 1) * 4


def test_rows_whose_kept_set_may_reach_past_the_candidates_take_the_whole_vocabulary(
    monkeypatch,
) -> None:
    """Among the `topk` candidates (the path where the sampling kernel's levels are not
    used): a flat row (its nucleus holds most of the vocabulary), a k-th value tied past the
    candidates, a nucleus that ends in a tie with the last candidate, and a row that is not
    finite at its top are filtered over the whole vocabulary: `_kept_among` says None, and
    `draw_rows` draws as the whole vocabulary does."""
    monkeypatch.setattr(sampling_kernel, "takes_logits", lambda x: False)
    vocab, n = 3000, sampling.CANDIDATES
    flat = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 0.1
    tied_k = torch.full((vocab,), -5.0)
    tied_k[:10] = torch.arange(10, 0, -1).float()
    tied_k[10 : n + 50] = 0.5  # the 11th largest value, tied past the candidates
    tied_p = torch.full((vocab,), -30.0)
    tied_p[: n + 100] = 1.0  # the nucleus runs into ties of the last candidate
    not_finite = peaked_logits(1, vocab, 3, torch.float32)[0]
    not_finite[7] = float("inf")
    cases = [
        (flat, SamplingParams(temperature=1.0, top_p=0.9)),
        (tied_k, SamplingParams(temperature=1.0, top_k=11)),
        (tied_p, SamplingParams(temperature=1.0, top_p=0.5)),
        (not_finite, SamplingParams(temperature=1.0, top_p=0.9)),
    ]
    for row, p in cases:
        top, order = torch.topk(row, n)
        order, by_token = order.sort()
        top, by_value = (top[by_token] / p.temperature).sort(descending=True, stable=True)
        u = torch.tensor([[0.37]], dtype=torch.float64)
        assert sampling._kept_among(row, top, order[by_value], p) is None
        if torch.isfinite(row).all():
            got = draw_rows(row[None], [p], u)
            assert torch.equal(got, whole_vocabulary(row[None], [p], u))


@pytest.mark.usefixtures("candidates")
def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    """A row drawn alone or beside a row with a large top-k (which widens the `topk`
    candidates every row is filtered among) gets the same token for the same uniform."""
    logits = peaked_logits(2, 5000, 5, torch.bfloat16).float()
    p = SamplingParams(temperature=0.7, top_p=0.9)
    wide = SamplingParams(temperature=0.7, top_k=2500)
    for seed in range(20):
        u = torch.rand(2, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        alone = draw_rows(logits[:1], [p], u[:1])
        beside = draw_rows(logits, [p, wide], u)
        assert alone[0] == beside[0]


def test_top_p_takes_equal_logits_in_vocabulary_order() -> None:
    """The nucleus of tied logits is the lowest-numbered of them (a stable sort), so it
    does not depend on how a sort broke the ties."""
    row = torch.zeros(1, 64)
    kept = filter_logits(row, SamplingParams(temperature=1.0, top_p=0.25))[0]
    assert torch.isfinite(kept).nonzero().flatten().tolist() == list(range(16))
