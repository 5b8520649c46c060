"""Next-token sampling for a batch: penalties, greedy, temperature, top-k/top-p/min-p, seeds.

Reported logprobs are those of the model's own distribution (log_softmax of the raw logits,
before penalties and temperature), as OpenAI reports them. Greedy rows take the argmax of the
penalised logits; sampled rows draw with their request's generator, so a seeded request gives
the same output whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from sessionserve.replicas.request import SamplingParams, TokenLogprob


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # per row, when any row asked for them


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """One row ([V]). Repetition penalty over prompt+output (HF semantics); frequency and
    presence penalties over the output (OpenAI semantics)."""
    if params.repetition_penalty != 1.0 and context:
        ids = torch.tensor(sorted(set(context)), dtype=torch.int64)
        picked = logits[ids]
        p = params.repetition_penalty
        logits[ids] = torch.where(picked > 0, picked / p, picked * p)
    if (params.frequency_penalty or params.presence_penalty) and output:
        ids, counts = torch.tensor(output, dtype=torch.int64).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype)
        logits[ids] -= params.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row ([V]); removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """`logits` [B, V] (float32). Row i uses params[i], its generator, its output so far and
    `contexts[i]` (prompt + output; only read by the repetition penalty, so it may be empty
    for rows without one)."""
    logits = logits.float()
    want_lp = any(p.logprobs for p in params)
    chosen = logits.argmax(dim=-1).tolist()  # greedy rows without penalties: done
    for i, p in enumerate(params):
        if p.is_greedy and not p.has_penalties:
            continue
        row = logits[i].clone()
        if p.has_penalties:
            row = apply_penalties(row, p, contexts[i], outputs[i])
        if p.is_greedy:
            chosen[i] = int(row.argmax())
            continue
        probs = filter_logits(row, p).softmax(-1)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    if not want_lp:
        return SampleOutput(chosen, None)
    lps = [
        token_logprobs(logits[i : i + 1], [tok], p.top_logprobs)[0] if p.logprobs else None
        for i, (tok, p) in enumerate(zip(chosen, params, strict=True))
    ]
    return SampleOutput(chosen, lps)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top_n: int
) -> list[TokenLogprob]:
    """Row i of `logits` ([N, V]) scored `token_ids[i]`: its logprob under the model's own
    distribution, with the `top_n` most likely alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    chosen = lp[torch.arange(len(ids)), ids].tolist()
    if top_n:
        vals, alt = lp.topk(top_n, dim=-1)
        tops = [
            tuple(zip(a, v, strict=True)) for a, v in zip(alt.tolist(), vals.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(ids)
    return [TokenLogprob(t, c, top) for t, c, top in zip(ids.tolist(), chosen, tops, strict=True)]
