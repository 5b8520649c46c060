"""Which drafts the target accepts: exact for greedy, distribution-preserving for sampling.

Greedy: a draft is kept while it equals the target's argmax at its position; the target's
argmax after the last kept draft is added. The output is the non-speculative greedy output.
A tree keeps the path of drafts that are the target's argmax after their parent.

Sampling (speculative rejection sampling, Leviathan et al. / Chen et al. 2023): draft `d` drawn
from `q` is kept with probability min(1, p(d) / q(d)); at the first rejection a token is drawn
from norm(max(p - q, 0)); if all are kept, one more is drawn from the target's next `p`. Each
emitted token is then distributed exactly as the target's `p` (after temperature, top-k, top-p
and min-p), whatever the drafter proposes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sessionserve.replicas.sampling import draw, uniforms


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the kept drafts, then the target's own token
    accepted: int  # drafts kept


def accept_greedy(best: Sequence[int], drafts: list[int]) -> Verdict:
    """`best` [k+1]: the target's argmax after draft i (row 0: after the last committed
    token; `greedy_tokens` of its logits, taken for a whole step's rows at once: one read
    back, where one a row cost ~0.13 ms each on a GPU host, 4.2 ms of a 22.7 ms speculative
    step at 32 requests, docs/benchmarks.md)."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(drafts[:n] + [best[n]], n)


def accept_greedy_tree(
    best: Sequence[int], drafts: list[int], parents: list[int]
) -> tuple[Verdict, list[int]]:
    """`best` [k+1]: the target's argmax after the pending token (row 0) and after draft i
    (row i + 1), as for `accept_greedy`. From the pending token, follow the child whose token
    is the target's argmax while there is one; returns the verdict and the kept drafts'
    indices (the path). The output is the non-speculative greedy output, as for a chain."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(drafts, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, i)
    path, node = [], -1
    while (nxt := children.get(node, {}).get(best[node + 1])) is not None:
        path.append(nxt)
        node = nxt
    tokens = [drafts[i] for i in path] + [best[node + 1]]
    return Verdict(tokens, len(path)), path


def accept_sampled(
    target_probs: torch.Tensor,  # [k+1, V]
    draft_probs: torch.Tensor,  # [k, V]: the distribution each draft was drawn from
    drafts: list[int],
    generator: torch.Generator | None,
) -> Verdict:
    """Random numbers come from `generator` on the host (see sampling.py), so the verdict
    is the same on any device: k acceptance uniforms, then one for the emitted token."""
    k = len(drafts)
    idx = torch.arange(k, device=target_probs.device)
    d = torch.tensor(drafts, dtype=torch.int64, device=target_probs.device)
    ratios = torch.stack([target_probs[idx, d], draft_probs[idx, d]], 1).double().cpu().tolist()
    accept_u = uniforms([generator], k)[0].tolist()
    for i in range(k):
        p_d, q_d = ratios[i]
        if accept_u[i] * q_d <= p_d:
            continue
        p, q = target_probs[i], draft_probs[i]
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself is the residual
            residual = p
        token = int(draw(residual[None], uniforms([generator]))[0])
        return Verdict(drafts[:i] + [token], i)
    token = int(draw(target_probs[k][None], uniforms([generator]))[0])
    return Verdict(drafts + [token], k)
