"""Sampling's per-row scans on a CPU (`sampling_kernel.cpp`): each row's greedy token
(`max(dim=-1).indices` in two vector passes over parts of the rows spread over the threads),
the inverse-CDF draw (`sampling.draw`'s float64 running sums in vocabulary order, without
their [rows, V] copy), the draw of a row with a temperature and min-p only, from its logits
(`temperature_draw`: no copies of the distribution at all), and the few tokens a top-k /
top-p row can keep (`nucleus_candidates`: no sort of the vocabulary, nor `topk`).

Why: torch's CPU reduction with an index costs ~1.3 cycles a logit and its float64 cumsum
~5 ns a probability, so with the vocabularies of current models (Gemma 3: 262,144; Llama 3:
128,256) picking a step's tokens took ~5% of a greedy decode step of 8 requests and drawing
them ~half of a sampled one's (docs/benchmarks.md). Greedy picks read fp32 or bf16 logits as
they are, so greedy steps skip their fp32 copy too. Built and loaded once per machine by
`native_kernel.NativeKernel` when an engine on a CPU is built (`load`); `takes_*` never
build. `SESSIONSERVE_SAMPLING_KERNEL=0` turns it off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel

SOURCE = Path(__file__).with_name("sampling_kernel.cpp")
DISABLE_ENV = "SESSIONSERVE_SAMPLING_KERNEL"  # "0": torch's ops instead
LOGIT_DTYPES = (torch.float32, torch.bfloat16)
log = logging.getLogger(__name__)


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::greedy_tokens")
    def _(logits):  # noqa: ANN001, ANN202 (torch's signature)
        return logits.new_empty(logits.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("sessionserve::inverse_cdf")
    def _(probs, u):  # noqa: ANN001, ANN202
        return probs.new_empty(probs.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("sessionserve::temperature_draw")
    def _(logits, temperature, min_p, u):  # noqa: ANN001, ANN202
        return logits.new_empty(logits.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("sessionserve::nucleus_candidates")
    def _(logits, temperature, top_k, top_p, limit):  # noqa: ANN001, ANN202
        rows, widest = logits.shape[0], torch.library.get_ctx().new_dynamic_size()
        return [
            logits.new_empty((rows, widest), dtype=torch.int64),
            logits.new_empty((rows, widest), dtype=torch.float32),
            logits.new_empty((rows,), dtype=torch.int64),
            logits.new_empty((rows,), dtype=torch.float64),
        ]


KERNEL = NativeKernel(SOURCE, DISABLE_ENV, "the CPU sampling kernel", _register_fake, log)
# build (once per machine) and load the ops; False, with the reason logged once, where they
# cannot be used here
load = KERNEL.load


def _rows_on_cpu(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] > 0
        and x.dtype in dtypes
        and x.stride(1) == 1
        and KERNEL.loaded()
    )


def takes_logits(logits: torch.Tensor) -> bool:
    """Whether the ops on logits (`greedy_tokens`, `temperature_draw`) take these: [rows,
    V > 0] fp32 or bf16 on a CPU, each row contiguous, with the kernel already loaded (this
    never builds it)."""
    return _rows_on_cpu(logits, LOGIT_DTYPES)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit [rows] int64: the first on a tie, the first NaN
    where a row holds one, as `logits.max(dim=-1).indices` (for logits `takes_logits`)."""
    return torch.ops.sessionserve.greedy_tokens(logits)


def takes_draw(probs: torch.Tensor) -> bool:
    """Whether `inverse_cdf` draws from these probabilities: [rows, V > 0] fp32 on a CPU,
    each row contiguous, with the kernel already loaded."""
    return _rows_on_cpu(probs, (torch.float32,))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's first index whose float64 running sum (vocabulary order) exceeds u[i] x
    the row's sum (V - 1 where none does) [rows] int64: `sampling.draw`'s pick (for
    probabilities `takes_draw`; `u` [rows] float64)."""
    return torch.ops.sessionserve.inverse_cdf(probs, u)


def temperature_draw(
    logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Row i drawn at u[i] from softmax(logits[i] / temperature[i]) with min-p (tokens whose
    probability is under min_p[i] x the largest get none) [rows] int64, without the
    distribution's [rows, V] copies: weights e^((x - max) / T) in float32 (0 under e^-87.3,
    where float32's softmax underflows too), summed in float64 in vocabulary order, the
    first token whose running sum exceeds u x the total. -1 for a row that holds a NaN or
    whose largest logit is infinite: the caller draws those rows as before. For logits
    `takes_logits`; `temperature`, `min_p` [rows] fp32, `u` [rows] float64."""
    return torch.ops.sessionserve.temperature_draw(logits, temperature, min_p, u)


def nucleus_candidates(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    limit: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row with top-k or top-p, the tokens whose weight e^((x - max) / T) reaches a
    level e^-d (d from 2 to 24) that holds its k largest (top_k[i] > 0) and more than top_p[i]
    of the row's mass (top_p[i] < 1), the first such level holding at most `limit` tokens: a
    set no token past it ties or exceeds, so the row's filter can be applied to it alone.
    Returns (tokens [rows, C] int64 in vocabulary order, their logits [rows, C] fp32, both
    unset past a row's count, how many a row has [rows] int64 (-1: no level fits, the row
    holds a NaN or an infinite top, or it asks for neither filter), the row's logsumexp after
    the temperature [rows] float64). For
    logits `takes_logits`; `temperature`, `top_p` [rows] fp32, `top_k` [rows] int64."""
    tokens, values, counts, log_total = torch.ops.sessionserve.nucleus_candidates(
        logits, temperature, top_k, top_p, limit
    )
    return tokens, values, counts, log_total
