"""Next-token sampling for a batch: penalties, greedy, temperature, top-k/top-p/min-p, seeds.

Everything runs batched on the logits' device; the chosen ids (and any logprobs) come back to
the host in one copy, which overlap scheduling starts on the forward thread and waits for on the
engine thread (`DeviceSample`), so the next step can launch before this one's tokens are read.
Randomness comes from each request's *CPU* generator as one uniform per draw, and the token is
found by inverse-CDF on the device: so a seeded request gives the same tokens on CPU and CUDA,
whatever else is in the batch (a CUDA generator would draw a different stream, and
`torch.multinomial` refuses a CPU generator for CUDA probabilities).

Reported logprobs are those of the model's own distribution (log_softmax of the raw logits,
before penalties and temperature), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sessionserve.replicas import sampling_kernel
from sessionserve.replicas.attention.base import to_device
from sessionserve.replicas.request import TokenLogprob
from sessionserve.wire import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first on a tie, as `argmax(-1)`: on a CPU the
    sampling kernel's (sampling_kernel.py, 8-19x faster), else `max(-1).indices`,
    which torch documents with the same tie rule and computes 2.2-2.9x faster than `argmax`
    on a CPU (torch 2.13, 2 threads: [8, 49152] fp32 96 against 279 us). Equal on ties, -inf
    and NaN rows (tests/unit/replicas/test_sampling.py)."""
    if sampling_kernel.takes_logits(logits):
        return sampling_kernel.greedy_tokens(logits)
    return logits.max(dim=-1).indices


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest softmax probability: a greedy pick's, what an EAGLE chain's
    `min_confidence` stop multiplies up. One formula for the eager chain and the CUDA graphs
    that stand in for it, so they stop chains alike."""
    return logits.softmax(-1).amax(-1)


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # per row, when any row asked for them


@dataclass
class DeviceSample:
    """A batch's sampled tokens (and logprob rows) still on the logits' device, packed into one
    float64 vector so they reach the host in one copy: [B] token ids (exact in float64), then
    one `logprob_table` row per row that asked, in row order."""

    packed: torch.Tensor
    rows: int
    want: list[int]  # which rows asked for logprobs
    tops: list[int]  # each such row's top_logprobs
    top_n: int  # the table's width in alternatives (max of `tops`)
    _host: torch.Tensor | None = None
    _ready: Any = None  # a CUDA event recorded after the copy

    @property
    def tokens(self) -> torch.Tensor:
        """The chosen ids [B] on the device (the next step's pending inputs read them)."""
        return self.packed[: self.rows].long()

    def start_copy(self) -> None:
        """Begin the device-to-host copy without waiting for it (pinned memory on CUDA)."""
        if self._host is not None:
            return
        if self.packed.device.type != "cuda":
            self._host = self.packed
            return
        self._host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
        self._host.copy_(self.packed, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def to_host(self) -> SampleOutput:
        """Wait for the copy (starting it if need be) and unpack it."""
        self.start_copy()
        if self._ready is not None:
            self._ready.synchronize()
        assert self._host is not None
        values = self._host.tolist()
        token_ids = [int(v) for v in values[: self.rows]]
        if not self.want:
            return SampleOutput(token_ids, None)
        width = 2 + 2 * self.top_n
        out: list[TokenLogprob | None] = [None] * self.rows
        for j, (i, n) in enumerate(zip(self.want, self.tops, strict=True)):
            row = values[self.rows + j * width : self.rows + (j + 1) * width]
            out[i] = parse_logprob_row(row, self.top_n, n)
        return SampleOutput(token_ids, out)


def uniforms(generators: Sequence[torch.Generator | None], n: int = 1) -> torch.Tensor:
    """[len(generators), n] float64 uniforms in [0, 1), row i from generators[i] (on CPU)."""
    return torch.stack([torch.rand(n, dtype=torch.float64, generator=g) for g in generators])


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i of `probs` ([N, V], unnormalised is fine) at uniform u[i].
    The float64 CDF makes the pick the same on any device for the same u; a token with zero
    probability is never picked (its CDF step is empty). On a CPU the sampling kernel sums
    the same float64 CDF in the same order without storing it (sampling_kernel.py)."""
    if sampling_kernel.takes_draw(probs):
        return sampling_kernel.inverse_cdf(probs, u.to(torch.float64).reshape(-1))
    cdf = probs.double().cumsum(-1)
    target = to_device(u.to(torch.float64), cdf.device).reshape(-1, 1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_max(probs.shape[-1] - 1)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """One row ([V]). Repetition penalty over prompt+output (HF semantics); frequency and
    presence penalties over the output (OpenAI semantics)."""
    dev = logits.device
    if params.repetition_penalty != 1.0 and context:
        ids = torch.tensor(sorted(set(context)), dtype=torch.int64, device=dev)
        picked = logits[ids]
        p = params.repetition_penalty
        logits[ids] = torch.where(picked > 0, picked / p, picked * p)
    if (params.frequency_penalty or params.presence_penalty) and output:
        ids, counts = torch.tensor(output, dtype=torch.int64, device=dev).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype)
        logits[ids] -= params.presence_penalty
    return logits


def filter_logits(
    logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; removed tokens get -inf. `logits` is one row [V] or a
    batch [B, V] with one params per row (or one for all). One sort serves top-k and top-p;
    it is stable, so equal logits (common in bf16) are taken in vocabulary order and a row's
    nucleus does not depend on how the sort broke ties."""
    row = logits.dim() == 1
    x = logits[None] if row else logits
    plist = [params] * x.shape[0] if isinstance(params, SamplingParams) else list(params)
    dev, vocab = x.device, x.shape[-1]

    def col(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=x.dtype), dev)[:, None]

    x = x / col([p.temperature for p in plist])
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in plist]
    top_p = [p.top_p for p in plist]
    if any(top_k) or min(top_p) < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        if any(top_k):
            kth_idx = to_device(torch.tensor([max(k, 1) - 1 for k in top_k]), dev)[:, None]
            kth = sorted_x.gather(-1, kth_idx)
            kth = torch.where(col([float(k > 0) for k in top_k]) > 0, kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if min(top_p) < 1.0:
            probs = sorted_x.softmax(-1)
            # drop a token once the mass before it already reaches top_p (the first stays)
            limit = col([t if t < 1.0 else float("inf") for t in top_p])
            sorted_x = sorted_x.masked_fill((probs.cumsum(-1) - probs) >= limit, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    min_p = [p.min_p for p in plist]
    if any(min_p):
        probs = x.softmax(-1)
        floor = col(min_p) * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < floor, float("-inf"))
    return x[0] if row else x


def draw_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Row i of `logits` [N, V] (any float dtype) filtered by params[i] (`filter_logits`) and
    drawn at u[i] (`draw`): the tokens [N]. On a CPU, rows with a temperature and min-p only
    are drawn from their logits by the sampling kernel (`_drawn_by_temperature`); rows with
    top-k or top-p whose kept tokens lie among their candidates (`_candidates_kept`: a weight
    level of the kernel's, or their `CANDIDATES` largest logits) over those alone; the
    others over the whole vocabulary, in fp32."""
    n = logits.shape[0]
    picks = torch.empty(n, dtype=torch.int64, device=logits.device)
    drawn = _drawn_by_temperature(logits, params, u, picks)
    if len(drawn) == n:
        return picks
    kept = _candidates_kept(logits, params)
    for i, (tokens, values) in kept.items():
        picks[i] = tokens[draw(values.softmax(0)[None], u[i].reshape(1, 1))[0]]
    rest = [i for i in range(n) if i not in kept and i not in drawn]
    if len(rest) == n:
        return draw(filter_logits(logits.float(), params).softmax(-1), u)
    if rest:
        rows = to_device(torch.tensor(rest), logits.device)
        probs = filter_logits(logits[rows].float(), [params[i] for i in rest]).softmax(-1)
        picks[rows] = draw(probs, u[rest])
    return picks


def _drawn_by_temperature(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor, picks: torch.Tensor
) -> set[int]:
    """Draws the rows that ask for neither top-k nor top-p (a temperature, maybe min-p: the
    OpenAI default is T 1) with `sampling_kernel.temperature_draw` into `picks`, where it takes
    the logits: which rows it drew (not those holding a NaN or an infinite top, left to
    `filter_logits`)."""
    vocab = logits.shape[-1]
    which = [i for i, p in enumerate(params) if p.top_p >= 1.0 and not 0 < p.top_k < vocab]
    if not which or not sampling_kernel.takes_logits(logits):
        return set()
    rows = None if len(which) == logits.shape[0] else torch.tensor(which)
    got = sampling_kernel.temperature_draw(
        logits if rows is None else logits[rows],
        torch.tensor([params[i].temperature for i in which], dtype=torch.float32),
        torch.tensor([params[i].min_p for i in which], dtype=torch.float32),
        u.to(torch.float64).reshape(len(params), -1)[which, 0],
    )
    if rows is None:
        picks.copy_(got)
    else:
        picks[rows] = got
    return {i for i, token in zip(which, got.tolist(), strict=True) if token >= 0}


def filtered_probs(
    logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]
) -> torch.Tensor:
    """`filter_logits(logits, params).softmax(-1)` [N, V]: each row's distribution after its
    filters, zero where they removed a token (what speculative acceptance compares drafts
    with). Rows whose kept tokens `_candidates_kept` finds get theirs without a sort of the
    whole vocabulary."""
    plist = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
    kept = _candidates_kept(logits, plist)
    if not kept:
        return filter_logits(logits, plist).softmax(-1)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    for i, (tokens, values) in kept.items():
        probs[i, tokens] = values.softmax(0)
    rest = [i for i in range(len(plist)) if i not in kept]
    if rest:
        rows = to_device(torch.tensor(rest), logits.device)
        probs[rows] = filter_logits(logits[rows], [plist[i] for i in rest]).softmax(-1)
    return probs


# How many of a row's largest logits a top-k / top-p row is filtered among before the whole
# vocabulary is sorted: a sort of 262,144 logits took ~11 ms a row on 2 cores, `topk` of 1,024
# ~0.5 ms (docs/benchmarks.md, stop 110). A nucleus past them (a flat distribution, a high
# temperature) is filtered over the whole vocabulary, as before.
CANDIDATES = 1024


def _candidates_kept(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """row -> (its kept tokens in vocabulary order, their logits after the temperature), for
    the rows of a CPU's `logits` with top-k or top-p whose kept set `_kept_among` finds among
    their candidates: those the sampling kernel finds above a level (`_level_kept`), else
    their largest logits (`topk`); the other rows are not in it."""
    vocab = logits.shape[-1]
    which = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if logits.device.type != "cpu" or not which:
        return {}
    x = logits if len(which) == logits.shape[0] else logits[torch.tensor(which)]
    found = _level_kept(x, which, params) if sampling_kernel.takes_logits(x) else {}
    rest = [j for j, i in enumerate(which) if i not in found]
    # top-k: past the k-th, to see where the tokens that tie it end (bf16 logits often tie)
    ks = [params[which[j]].top_k + 1 if 0 < params[which[j]].top_k < vocab else 0 for j in rest]
    wanted = max([*ks, CANDIDATES])
    if not rest or wanted >= vocab:
        return found
    x = x if len(rest) == x.shape[0] else x[torch.tensor(rest)]
    # the largest logits before the temperature (dividing keeps their order), then divided
    # as filter_logits divides them: each row of x / temperature, exactly rounded either way
    top, order = torch.topk(x, wanted, dim=-1)
    temperature = torch.tensor([params[which[j]].temperature for j in rest])[:, None]
    top = top.float() / temperature
    # in filter_logits' order: largest first, equal values in vocabulary order
    order, by_token = order.sort(dim=-1)
    top, by_value = top.gather(-1, by_token).sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, by_value)
    for n, j in enumerate(rest):
        i = which[j]
        kept = _kept_among(x[n], top[n], order[n], params[i])
        if kept is not None:
            found[i] = kept
    return found


def _level_kept(
    x: torch.Tensor, which: list[int], params: Sequence[SamplingParams]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`_candidates_kept` for rows `which` (x's rows, on a CPU) from the sampling kernel's
    candidates (`nucleus_candidates`): tokens above a level of weight that holds the row's
    k largest and its nucleus, so nothing past them ties them; rows it finds none for (or
    whose kept set `_kept_among` cannot settle) are not in it."""
    vocab = x.shape[-1]
    temperature = torch.tensor([params[i].temperature for i in which], dtype=torch.float32)
    top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in which])
    top_p = torch.tensor([params[i].top_p for i in which], dtype=torch.float32)
    # no limit: the first level that holds a row's nucleus is never more than its vocabulary,
    # and a flat row's (tens of thousands of tokens at T 0.7 on word salad) sorts in a
    # fraction of the whole row's time
    tokens, values, counts, log_total = sampling_kernel.nucleus_candidates(
        x, temperature, top_k, top_p, vocab
    )
    found = {}
    for j, (i, n) in enumerate(zip(which, counts.tolist(), strict=True)):
        if n < 0:
            continue
        # as filter_logits divides (fp32 by the fp32 temperature), then its order: largest
        # first, equal values in vocabulary order (the tokens come in vocabulary order)
        top, by_value = (values[j, :n] / temperature[j]).sort(descending=True, stable=True)
        kept = _kept_among(x[j], top, tokens[j, :n][by_value], params[i], log_total[j], True)
        if kept is not None:
            found[i] = kept
    return found


def _kept_among(
    row: torch.Tensor,
    top: torch.Tensor,
    order: torch.Tensor,
    p: SamplingParams,
    total: torch.Tensor | None = None,
    complete: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`filter_logits` for one row (`row` [V], before the temperature) from its largest
    values `top` (temperature applied; descending, equal ones in vocabulary order) at
    `order`: the kept tokens in vocabulary order and their values; None where the kept set
    may reach past them (a tie at the k-th value runs to their end, the nucleus holds more
    than they do or ends in a tie with their last), or the row is not finite at its top.
    `complete`: every token past `top` is smaller than all of them (a level's set), so no
    tie reaches past them. `total`: the row's logsumexp after the temperature, where known."""
    if not torch.isfinite(top[0]):
        return None
    smallest = top[-1]  # the candidates' last value, which tokens past them may tie
    k = p.top_k if 0 < p.top_k < row.shape[0] else 0
    if k:
        if top.shape[0] < k:
            return None
        kth = top[k - 1]
        if not complete and smallest >= kth:  # tokens past the candidates may tie the k-th
            return None
        top = top.masked_fill(top < kth, float("-inf"))
        total = torch.logsumexp(top, 0)
    elif total is None:
        # the nucleus' mass is of the whole row
        total = torch.logsumexp(row.float() / p.temperature, 0)
    if p.top_p < 1.0:
        probs = (top - total).exp()
        if not k and float(probs.sum()) < p.top_p:  # the nucleus reaches past the candidates
            return None
        # as filter_logits: drop a token once the mass before it already reaches top_p
        top = top.masked_fill((probs.cumsum(0) - probs) >= p.top_p, float("-inf"))
    if p.min_p:
        probs = top.softmax(0)
        top = top.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    kept = top > float("-inf")
    if not complete and top.shape[0] < row.shape[0] and bool(top[kept][-1] == smallest):
        return None  # the last kept value ties tokens that may lie past the candidates
    tokens, by_token = order[kept].sort()  # a draw's CDF runs in vocabulary order
    return tokens, top[kept][by_token]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """`sample_on_device`, read back at once."""
    return sample_on_device(logits, params, contexts, outputs, generators).to_host()


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> DeviceSample:
    """`logits` [B, V] on any device. Row i uses params[i], its generator, its output so far
    and `contexts[i]` (prompt + output; only read by the repetition penalty, so it may be
    empty for rows without one). Nothing here waits for the device: host values reach it
    through pinned copies (`to_device`)."""
    raw = logits  # (logprobs: `logprob_table` takes them in fp32)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    # penalties compute in fp32; greedy picks and draws read the logits as they are (bf16 to
    # fp32 is exact; `draw_rows` copies to fp32 only the rows it filters in torch), which
    # spares most steps the copy
    if penalised:
        logits = logits.to(torch.float32, copy=True)
        for i in penalised:
            apply_penalties(logits[i], params[i], contexts[i], outputs[i])
    if not sampled:
        chosen = greedy_tokens(logits)
    elif len(sampled) == len(params):  # no greedy pick, nor a copy of the rows
        chosen = draw_rows(logits, params, uniforms(generators))
    else:
        rows = to_device(torch.tensor(sampled), logits.device)
        u = uniforms([generators[i] for i in sampled])
        picks = draw_rows(logits[rows], [params[i] for i in sampled], u)
        chosen = greedy_tokens(logits).index_copy(0, rows, picks)
    parts = [chosen.double()]
    want = [i for i, p in enumerate(params) if p.logprobs]
    tops = [params[i].top_logprobs for i in want]
    top_n = max(tops, default=0)
    if want:
        rows = to_device(torch.tensor(want), logits.device)
        parts.append(logprob_table(raw[rows], chosen[rows], top_n).flatten())
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)  # (no logprobs: no copy)
    return DeviceSample(packed, len(params), want, tops, top_n)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, top_n: int
) -> list[TokenLogprob]:
    """Row i of `logits` ([N, V]) scored `token_ids[i]`: its logprob under the model's own
    distribution, with the `top_n` most likely alternatives (one device-to-host copy)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    table = logprob_table(logits, to_device(ids, logits.device), top_n)
    return [parse_logprob_row(r, top_n, top_n) for r in table.cpu().tolist()]


def logprob_table(logits: torch.Tensor, ids: torch.Tensor, top_n: int) -> torch.Tensor:
    """[N, 2 + 2 * top_n] float64 on the logits' device: per row the token id, its logprob
    (log_softmax of `logits`), then the `top_n` best logprobs and their ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, ids[:, None])
    if not top_n:
        return torch.cat([ids[:, None].double(), chosen.double()], 1)
    vals, alt = lp.topk(top_n, dim=-1)
    return torch.cat([ids[:, None].double(), chosen.double(), vals.double(), alt.double()], 1)


def parse_logprob_row(row: Sequence[float], top_n: int, keep: int) -> TokenLogprob:
    """One `logprob_table` row, read back, keeping the first `keep` of its alternatives."""
    top = tuple(zip((int(a) for a in row[2 + top_n :]), row[2 : 2 + top_n], strict=True))
    return TokenLogprob(int(row[0]), row[1], top[:keep])
