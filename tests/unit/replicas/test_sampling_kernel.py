"""The CPU sampling kernel (replicas/sampling_kernel.cpp): on an x86 CPU with AVX2 or AVX-512
and a C++ compiler, each row's greedy token is `argmax(-1)`'s on every case a shortcut could
get wrong (ties, -inf, +inf, NaN, rows not packed together, rows longer than its parts), and
each row's inverse-CDF draw is the float64 cumsum-and-searchsorted pick, and a row's draw from
its logits with a temperature and min-p is torch's pick but where the uniform falls within
float32 rounding of a token's edge, and a top-k / top-p row's candidates hold what its
filters keep with nothing tied past them, built for AVX-512 and for AVX2 alike; what it does
not take is torch's, and the ops refuse it with what they need; an engine on a CPU loads it."""

from __future__ import annotations

import pytest
import torch

from sessionserve.replicas import sampling, sampling_kernel
from sessionserve.replicas.sampling import draw, draw_rows, filter_logits, greedy_tokens
from sessionserve.wire import SamplingParams
from tests.child_python import run_child
from tests.unit.replicas.test_sampling import FILTERS, argmax_cases, peaked_logits


@pytest.fixture(scope="module")
def kernel() -> None:
    if not sampling_kernel.load():
        pytest.skip(f"the sampling kernel cannot be built here: {sampling_kernel.KERNEL.why_not()}")


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_argmax_on_every_case(dtype, threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for logits in argmax_cases(dtype):
            assert sampling_kernel.takes_logits(logits)
            assert torch.equal(sampling_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
            assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("kernel")
def test_what_the_kernel_does_not_take_is_torchs_and_the_op_says_why() -> None:
    """fp16, one-dimensional, empty and column-strided logits are torch's: `greedy_tokens`
    still gives argmax, and the op refuses them with what it needs."""
    logits = torch.randn(4, 300)
    for other in (logits.half(), logits[:, ::2], logits.T, logits[0], logits[:, :0]):
        assert not sampling_kernel.takes_logits(other)
        if other.numel():
            assert torch.equal(greedy_tokens(other), other.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        sampling_kernel.greedy_tokens(logits.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.greedy_tokens(logits[:, ::2])
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        sampling_kernel.greedy_tokens(logits[:, :0])
    assert sampling_kernel.greedy_tokens(logits[:0]).shape == (0,)


def torch_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sampling.draw`'s pick as torch computes it: the float64 CDF, then searchsorted."""
    cdf = probs.double().cumsum(-1)
    target = u.reshape(-1, 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)


def draw_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Probabilities and uniforms: normalised and not, with zero runs (a filtered row), one
    token, rows not packed together, and the uniforms' ends (0, and just under 1)."""
    gen = torch.Generator().manual_seed(1)
    cases = []
    for rows, vocab in [(1, 1), (1, 7), (3, 1000), (8, 49152), (2, 262144)]:
        probs = (torch.randn(rows, vocab, generator=gen) * 3).softmax(-1)
        probs[0, ::5] = 0.0
        for s in range(6):
            u = torch.rand(rows, dtype=torch.float64, generator=gen)
            u[0] = 0.0 if s == 0 else u[0]
            u[-1] = 1.0 - 2.0**-53 if s == 1 else u[-1]
            cases.append((probs, u))
        cases.append((probs * 7.5, u))  # unnormalised
        wide = torch.rand(rows, vocab + 5, generator=gen)
        cases.append((wide[:, 5:], u))
    return cases


@pytest.mark.usefixtures("kernel")
def test_the_draw_is_torchs_float64_cdf_pick_on_every_case() -> None:
    for probs, u in draw_cases():
        assert sampling_kernel.takes_draw(probs)
        want = torch_draw(probs, u)
        assert torch.equal(sampling_kernel.inverse_cdf(probs, u), want)
        assert torch.equal(draw(probs, u[:, None]), want)
        live = probs.sum(-1) > 0  # (a row of one token, zeroed, has nothing to draw)
        assert bool((probs.gather(1, want[:, None])[live] > 0).all())  # no zero-probability pick


@pytest.mark.usefixtures("kernel")
def test_what_the_draw_does_not_take_is_torchs_and_the_op_says_why() -> None:
    probs, u = torch.rand(3, 50).softmax(-1), torch.rand(3, dtype=torch.float64)
    for other in (probs.double(), probs[:, ::2], probs.t().contiguous().t()):
        assert not sampling_kernel.takes_draw(other)
        assert torch.equal(draw(other, u[:, None]), torch_draw(other, u))
    with pytest.raises(RuntimeError, match="fp32 probabilities"):
        sampling_kernel.inverse_cdf(probs.double(), u)
    with pytest.raises(RuntimeError, match="one float64 uniform a row"):
        sampling_kernel.inverse_cdf(probs, u.float())
    with pytest.raises(RuntimeError, match="one float64 uniform a row"):
        sampling_kernel.inverse_cdf(probs, u[:2])
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.inverse_cdf(probs[:, ::2], u)


TemperatureCase = tuple[torch.Tensor, float, float, torch.Tensor]


def temperature_cases() -> list[TemperatureCase]:
    """Logits, a temperature, a min-p and uniforms: fp32 and bf16 (whose rounding ties many
    logits), rows shorter than a vector and across the kernel's chunk (256) and part (16,384)
    edges up to Gemma 3's vocabulary, -inf runs (a grammar's mask), rows not packed together,
    temperatures that sharpen to near-greedy and flatten, min-p, the uniforms' ends."""
    gen = torch.Generator().manual_seed(2)
    cases = []
    for rows, vocab in [(1, 1), (2, 7), (3, 257), (4, 16385), (8, 49152), (2, 262144)]:
        for dtype in (torch.float32, torch.bfloat16):
            wide = torch.randn(rows, vocab + 3, generator=gen) * 4
            wide[0, 3::3] = float("-inf")
            wide[0, 3] = 2.0  # (a row of one token keeps it)
            logits = wide[:, 3:].to(dtype)
            for temperature, min_p in [(1.0, 0.0), (0.7, 0.0), (0.05, 0.0), (2.5, 0.1), (1.0, 0.5)]:
                u = torch.rand(rows, dtype=torch.float64, generator=gen)
                u[0] = 0.0
                u[-1] = 1.0 - 2.0**-53 if rows > 1 else u[-1]
                cases.append((logits, temperature, min_p, u))
    return cases


def reference_cdf(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """Each row's CDF in float64, min-p applied: what a draw should follow."""
    x = logits.double()
    weight = ((x - x.max(-1, keepdim=True).values) / temperature).exp()
    weight = weight.masked_fill(weight < min_p, 0.0)
    return weight.cumsum(-1) / weight.sum(-1, keepdim=True)


def assert_fair_picks(case: TemperatureCase, got: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Every pick is torch's (`filter_logits`, softmax, `draw`) or, where they differ, a
    token the float64 CDF puts within `tolerance` of the uniform, with a weight: a rounding
    edge, not a different distribution. Returns nothing; asserts."""
    logits, temperature, min_p, u = case
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * logits.shape[0]
    want = draw(filter_logits(logits.float(), params).softmax(-1), u[:, None])
    cdf = reference_cdf(logits, temperature, min_p)
    for row in (got != want).nonzero().flatten().tolist():
        token = int(got[row])
        start = float(cdf[row, token - 1]) if token else 0.0
        assert float(cdf[row, token]) > start, (case[1:3], row, token)  # it has a weight
        assert start - tolerance <= float(u[row]) < float(cdf[row, token]) + tolerance


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_temperature_draw_is_torchs_pick_but_at_rounding_edges(threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    same = total = 0
    try:
        for case in temperature_cases():
            logits, temperature, min_p, u = case
            assert sampling_kernel.takes_logits(logits)
            rows = logits.shape[0]
            got = sampling_kernel.temperature_draw(
                logits, torch.full((rows,), temperature), torch.full((rows,), min_p), u
            )
            assert_fair_picks(case, got)
            params = [SamplingParams(temperature=temperature, min_p=min_p)] * rows
            assert torch.equal(draw_rows(logits, params, u[:, None]), got)
            want = draw(filter_logits(logits.float(), params).softmax(-1), u[:, None])
            same, total = same + int((got == want).sum()), total + rows
    finally:
        torch.set_num_threads(before)
    assert same >= 0.97 * total  # (the differences: a uniform of 0 on near-greedy rows)


@pytest.mark.usefixtures("kernel")
def test_rows_the_temperature_draw_cannot_take_are_drawn_by_torch() -> None:
    """A row holding a NaN, one whose top is +inf and one all -inf get -1 from the op, and
    `draw_rows` draws them as `filter_logits` does, beside rows the kernel drew; top-k and
    top-p rows never reach the op."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3000, generator=gen)
    logits[0, 17] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    u = torch.rand(6, dtype=torch.float64, generator=gen)
    ones = torch.ones(6)
    got = sampling_kernel.temperature_draw(logits, ones, torch.zeros(6), u)
    assert got[:3].tolist() == [-1, -1, -1] and bool((got[3:] >= 0).all())
    params = [SamplingParams(temperature=1.0)] * 5 + [SamplingParams(temperature=1.0, top_p=0.5)]
    picks = draw_rows(logits, params, u[:, None])
    whole = draw(filter_logits(logits, params).softmax(-1), u[:, None])
    assert torch.equal(picks[:3], whole[:3]) and torch.equal(picks[3:5], got[3:5])
    assert int(picks[5]) == int(whole[5])


@pytest.mark.usefixtures("kernel")
def test_the_temperature_draw_refuses_what_it_cannot_take_with_what_it_needs() -> None:
    logits, u = torch.randn(3, 50), torch.rand(3, dtype=torch.float64)
    ones, zeros = torch.ones(3), torch.zeros(3)
    with pytest.raises(RuntimeError, match="fp32 or bf16 logits"):
        sampling_kernel.temperature_draw(logits.half(), ones, zeros, u)
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.temperature_draw(logits[:, ::2], ones, zeros, u)
    with pytest.raises(RuntimeError, match="temperatures > 0"):
        sampling_kernel.temperature_draw(logits, torch.tensor([1.0, 0.0, 1.0]), zeros, u)
    with pytest.raises(RuntimeError, match="one fp32 temperature and min-p a row"):
        sampling_kernel.temperature_draw(logits, ones[:2], zeros, u)
    with pytest.raises(RuntimeError, match="one float64 uniform a row"):
        sampling_kernel.temperature_draw(logits, ones, zeros, u.float())
    assert sampling_kernel.temperature_draw(logits[:0], ones[:0], zeros[:0], u[:0]).shape == (0,)


def level_cases() -> list[tuple[torch.Tensor, list[SamplingParams]]]:
    """Rows and their top-k / top-p filters: a model's shape (a few large logits over a long
    tail) in fp32 and bf16, flat rows, many-way ties at the k-th value and across the
    nucleus, a row without a filter, NaN and +inf rows, up to Gemma 3's vocabulary."""
    cases = []
    for seed, vocab in enumerate([300, 5000, 16385, 262144]):
        for dtype in (torch.float32, torch.bfloat16):
            logits = peaked_logits(len(FILTERS), vocab, seed, dtype)
            cases.append((logits, FILTERS))
    flat = torch.randn(3, 5000, generator=torch.Generator().manual_seed(7)) * 0.1
    cases.append((flat, [SamplingParams(temperature=1.0, top_p=0.9)] * 2 + [FILTERS[2]]))
    tied = torch.full((4, 3000), -5.0)
    tied[:, :10] = torch.arange(10, 0, -1).float()
    tied[:, 10:1100] = 0.5
    tied[2, :1124], tied[3, 7] = 1.0, float("nan")
    tied[1, 3] = float("inf")
    cases.append(
        (
            tied,
            [
                SamplingParams(temperature=1.0, top_k=11),
                SamplingParams(temperature=1.0, top_p=0.9),
                SamplingParams(temperature=1.0, top_p=0.5),
                SamplingParams(temperature=1.0, top_k=5),
            ],
        )
    )
    cases.append((tied[:1], [SamplingParams(temperature=0.7)]))  # no filter: not its op
    return cases


def assert_levels_hold_what_the_filters_keep(
    logits: torch.Tensor, params: list[SamplingParams], limit: int
) -> list[int]:
    """`nucleus_candidates`' sets: in vocabulary order with their logits, at most `limit`,
    holding the k largest and more than top-p of the mass, every token past them smaller
    than all of them, the row's logsumexp; -1 only for rows it may not take (NaN, +inf, no
    filter) or where no level fits. Returns the counts."""
    rows, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params])
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    tokens, values, counts, log_total = sampling_kernel.nucleus_candidates(
        logits, temperature, top_k, top_p, limit
    )
    x = logits.double() / temperature.double()[:, None]
    for r in range(rows):
        n = int(counts[r])
        finite = not bool(logits[r].float().isnan().any()) and bool(logits[r].max() < float("inf"))
        if not finite or (not top_k[r] and top_p[r] >= 1.0):
            assert n == -1
            continue
        if n < 0:
            continue
        assert 0 < n <= limit and n >= int(top_k[r])
        held = tokens[r, :n]
        assert bool((held[1:] > held[:-1]).all())  # vocabulary order
        assert torch.equal(values[r, :n], logits[r, held].float())
        past = torch.ones(vocab, dtype=torch.bool)
        past[held] = False
        if bool(past.any()):
            assert float(logits[r][past].max()) < float(values[r, :n].min())
        probs = x[r].softmax(0)
        assert float(probs[held].sum()) >= float(top_p[r]) or top_p[r] >= 1.0
        assert abs(float(log_total[r]) - float(torch.logsumexp(x[r], 0))) < 1e-5
    return counts.tolist()


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2])
def test_levels_hold_a_rows_k_largest_and_its_nucleus_with_nothing_tied_past_them(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        taken = 0
        for logits, params in level_cases():
            counts = assert_levels_hold_what_the_filters_keep(logits, params, 4096)
            taken += sum(n >= 0 for n in counts)
            if logits.shape[1] > 64:  # a limit no level fits: none taken
                tight = assert_levels_hold_what_the_filters_keep(logits, params, 0)
                assert tight == [-1] * len(params)
        assert taken >= 0.8 * sum(len(p) for _, p in level_cases())
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("kernel")
def test_ties_in_a_level_are_filtered_as_over_the_whole_vocabulary() -> None:
    """A k-th value tied 1,090 ways, wholly inside a level, keeps every tie as `filter_logits`
    does, and draws as it does; a nucleus of 1,124 equal tokens at top-p 0.5 ends at its
    exact half (562), where the whole row's fp32 cumsum may keep one more."""
    tied = torch.full((3000,), -5.0)
    tied[:10] = torch.arange(10, 0, -1).float()
    tied[10:1100] = 0.5
    p = SamplingParams(temperature=1.0, top_k=11)
    ((tokens, _),) = sampling._candidates_kept(tied[None], [p]).values()
    assert torch.equal(tokens, torch.isfinite(filter_logits(tied, p)).nonzero().flatten())
    for seed in range(10):
        u = torch.rand(1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        want = draw(filter_logits(tied[None], [p]).softmax(-1), u)
        assert torch.equal(draw_rows(tied[None], [p], u), want)
    half = torch.full((3000,), -30.0)
    half[:1124] = 1.0
    p = SamplingParams(temperature=1.0, top_p=0.5)
    ((tokens, _),) = sampling._candidates_kept(half[None], [p]).values()
    assert tokens.tolist() == list(range(562))
    assert int(torch.isfinite(filter_logits(half, p)).sum()) in (562, 563)


@pytest.mark.usefixtures("kernel")
def test_nucleus_candidates_refuse_what_they_cannot_take_with_what_they_need() -> None:
    logits = torch.randn(3, 50)
    ones, ks, ps = torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.full((3,), 0.9)
    with pytest.raises(RuntimeError, match="fp32 or bf16 logits"):
        sampling_kernel.nucleus_candidates(logits.half(), ones, ks, ps, 10)
    with pytest.raises(RuntimeError, match="contiguous"):
        sampling_kernel.nucleus_candidates(logits[:, ::2], ones, ks, ps, 10)
    with pytest.raises(RuntimeError, match="temperatures > 0"):
        sampling_kernel.nucleus_candidates(logits, -ones, ks, ps, 10)
    with pytest.raises(RuntimeError, match="one int64 top-k a row"):
        sampling_kernel.nucleus_candidates(logits, ones, ks.int(), ps, 10)
    with pytest.raises(RuntimeError, match="one fp32 temperature and top-p a row"):
        sampling_kernel.nucleus_candidates(logits, ones, ks, ps[:2], 10)


def test_an_engine_on_a_cpu_loads_the_kernel_and_off_it_stays_torchs() -> None:
    """An engine built on a CPU loads the kernel before its first step; with
    SESSIONSERVE_SAMPLING_KERNEL=0 it is never built, and greedy answers and a seeded one at
    temperature 1 (drawn by `temperature_draw`) are the same."""
    script = """
        import torch
        from sessionserve.replicas import sampling_kernel
        from sessionserve.wire import SamplingParams
        from tests.models import tiny_engine, tiny_model

        assert not sampling_kernel.KERNEL.loaded()
        engine = tiny_engine(tiny_model())
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        print("loaded", sampling_kernel.KERNEL.loaded())
        print("tokens", engine.generate([[5, 9, 13, 17]], params)[0].output_ids)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
        print("sampled", engine.generate([[5, 9, 13, 17]], params)[0].output_ids)
    """
    out = {}
    for setting in ("1", "0"):
        stdout = run_child(script, SESSIONSERVE_SAMPLING_KERNEL=setting)
        out[setting] = dict(line.split(" ", 1) for line in stdout.splitlines())
    if sampling_kernel.load():
        assert out["1"]["loaded"] == "True"
    assert out["0"]["loaded"] == "False"
    assert out["1"]["tokens"] == out["0"]["tokens"]
    assert out["1"]["sampled"] == out["0"]["sampled"]


AVX2_SCRIPT = """
    import torch
    from sessionserve.replicas import sampling_kernel
    from tests.unit.replicas.test_sampling import FILTERS, argmax_cases, peaked_logits
    from tests.unit.replicas.test_sampling_kernel import (
        assert_fair_picks, assert_levels_hold_what_the_filters_keep, draw_cases, level_cases,
        temperature_cases, torch_draw
    )

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert sampling_kernel.load(), sampling_kernel.KERNEL.why_not()
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for logits in argmax_cases(dtype):
            assert torch.equal(sampling_kernel.greedy_tokens(logits), logits.argmax(dim=-1))
    for probs, u in draw_cases():
        assert torch.equal(sampling_kernel.inverse_cdf(probs, u), torch_draw(probs, u))
    for case in temperature_cases():
        logits, temperature, min_p, u = case
        rows = logits.shape[0]
        t, m = torch.full((rows,), temperature), torch.full((rows,), min_p)
        assert_fair_picks(case, sampling_kernel.temperature_draw(logits, t, m, u))
    for logits, params in level_cases():
        assert_levels_hold_what_the_filters_keep(logits, params, 4096)
    print("AVX2 OK")
"""


@pytest.mark.usefixtures("kernel")
def test_the_avx2_build_picks_and_draws_the_same() -> None:
    """The same cases through the kernel built for AVX2 (torch told its CPU is AVX2: 8-lane
    vectors), in a process of its own."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        pytest.skip("this CPU runs no AVX2 code")
    run_child(AVX2_SCRIPT, "AVX2 OK", ATEN_CPU_CAPABILITY="avx2")
