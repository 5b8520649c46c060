"""The EAGLE head's step compiled ahead of time, as the target's forward is (compiled_forward.py).

Why: on a CPU the eager head step (one decoder layer, then its draft-vocabulary GEMM) ran on
one core at a few ms, and a step drafting a chain of k = 4 makes four of them (k - 1 chain
steps and the catch-up): the head's proposals and catch-up took 28-36% of decode time
(docs/benchmarks.md, "EAGLE-3 heads and EAGLE-2 draft trees"), more than its drafts saved.
Inductor's GEMM templates use both cores and fuse the norms, rotary and activation around them;
attention stays our opaque op over the head's own KV pool (`sessionserve::paged_attention`,
layer 0 of the pool the proposer passes in its `ForwardMeta`).

`HeadStep` is what is exported: (token ids [T], input hidden states [T, W], positions [T],
rows wanted [N]) -> (draft logits [N, Vd], the head's output [T, h]). Its inputs' width W is
fixed in a package: an EAGLE-1/2 head reads the target's last hidden state and feeds back its
own (both h wide), so one package serves it; an EAGLE-3 head reads three target layers (3h)
when catching up and its own output (h) when chaining, so it gets a package for each.
The target's embedding and LM head, which the head borrows, are registered here so that export
sees them as weights (and the package key hashes them).

Its linears and its draft-vocabulary GEMM (`HeadLinears`, swapped in on the copy that is
exported, as the target's decode step packages' are): an fp32 head's run the few-row GEMM
kernel (cpu_linear.py) where it builds; a bf16 head's run the block kernel (block_linear.py)
on 8-bit records of its weights where that loads (AVX-512 VNNI): a step of one row reads
half the bytes, and its GEMMs took 0.20 ms against 1.15 ms as bf16 on 2 cores of an AMD
EPYC Zen 4 (docs/benchmarks.md). The records hold each weight within half a step of 1/255 of
its block's range: the drafts may differ from the dense head's, the served tokens never do
(the target verifies them).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from sessionserve.replicas import block_linear, cpu_linear, gguf_int4
from sessionserve.replicas.attention.base import ForwardMeta
from sessionserve.replicas.attention.paged_op import forward_context
from sessionserve.replicas.compiled_forward import (
    CompiledForward,
    CompileJob,
    CompilePlan,
    package_key,
    token_dims,
)
from sessionserve.replicas.native_kernel import SHIMS_CONFIG
from sessionserve.replicas.speculative.drafter import DraftHead

# what a head package's linears run: inductor's GEMMs ("dense"), the fp32 few-row kernel
# ("packed", cpu_linear.py) or 8-bit records on the block kernel ("blocks", block_linear.py)
HeadLinears = Literal["dense", "packed", "blocks"]


class HeadStep(nn.Module):
    """One drafter forward and its draft logits, for inputs `input_width` wide."""

    def __init__(
        self, drafter: DraftHead, input_width: int, linears: HeadLinears = "dense"
    ) -> None:
        super().__init__()
        self.drafter = drafter
        embedding, lm_head = drafter._borrowed()
        self.borrowed_embedding = embedding
        self.borrowed_lm_head = lm_head
        self.config = drafter.config
        self.input_width = input_width
        self.linears = linears
        # the EAGLE-1/2 head's draft-vocabulary GEMM on a kernel (`export_inputs`)
        self.draft_vocab: nn.Module | None = None
        if hasattr(drafter, "head_weight"):  # the EAGLE-1/2 head's cached draft-vocabulary
            drafter.head_weight()  # rows: made here, not assigned while export traces

    def forward(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        logit_idx: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.drafter.features(ids[None], hidden[None], positions[None])[0]
        if self.draft_vocab is not None:
            return self.draft_vocab(out[logit_idx]), out
        return self.drafter.draft_logits(out[logit_idx]), out

    def export_inputs(
        self, example_tokens: int, max_tokens: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Any], ...]]:
        """As `_DecoderAndHead.export_inputs`, with the input hidden states beside the ids."""
        # on the copy that is exported; not the borrowed LM head (unused here). The EAGLE-1/2
        # head's draft-vocabulary rows are swapped apart (an EAGLE-3 head's own `lm_head` is
        # one of its linears)
        weight = self.drafter.head_weight() if hasattr(self.drafter, "head_weight") else None
        if self.linears == "packed":
            cpu_linear.swap_linears(self.drafter)
            if weight is not None and cpu_linear.fits(weight):
                self.draft_vocab = cpu_linear.PackedLinear(weight)
        elif self.linears == "blocks":
            records = {
                name: blocks
                for name, child in self.drafter.named_modules()
                if type(child) is nn.Linear
                and (blocks := gguf_int4.eight_bit_weight(child.weight)) is not None
            }
            gguf_int4.swap_block_linears(self.drafter, records)
            vocab = gguf_int4.eight_bit_weight(weight) if weight is not None else None
            if vocab is not None:
                self.draft_vocab = block_linear.BlockLinear(vocab, None, weight.dtype)
        tokens, rows = token_dims(max_tokens)
        n = example_tokens
        dtype = next(self.drafter.parameters()).dtype
        example = (
            torch.zeros(n, dtype=torch.int64),
            torch.zeros(n, self.input_width, dtype=dtype),
            torch.arange(n),
            torch.arange(n - 2, n),
        )
        dynamic = ({0: tokens}, {0: tokens}, {0: tokens}, {0: rows})
        return tuple(t.to(device) for t in example), dynamic

    def key_facts(self) -> dict[str, Any]:
        """What the package depends on besides the weights and the config (`package_key`)."""
        return {
            "head": type(self.drafter).__name__,
            "input_width": self.input_width,
            "feature_layers": list(self.drafter.feature_layers or ()),
            # only where used: packages built before stay valid
            **({"linear_kernel": cpu_linear.key_fact()} if self.linears == "packed" else {}),
            **({"eight_bit_blocks": block_linear.key_fact()} if self.linears == "blocks" else {}),
        }

    @property
    def inductor_configs(self) -> dict[str, Any]:
        """The kernel's C function, for a package that calls it (`build_package`)."""
        if self.linears == "dense":
            return {}
        kernel = cpu_linear if self.linears == "packed" else block_linear
        return {SHIMS_CONFIG: kernel.c_shims()}


class CompiledHead(CompiledForward):
    """A loaded head package: `run(ids, hidden, positions, logit_idx, meta)`."""

    def __init__(
        self, package: Path, max_tokens: int, min_tokens: int = 1, linears: HeadLinears = "dense"
    ) -> None:
        # the package calls its kernel by name: the op must exist first
        if linears == "packed":
            cpu_linear.load()
        elif linears == "blocks":
            block_linear.load()
        super().__init__(package, max_tokens, min_tokens)

    def run(  # type: ignore[override] - the head's step also takes its input hidden states
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        logit_idx: torch.Tensor,
        meta: ForwardMeta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [N, Vd] and the head's output [T, h] (a step that wants no logits
        computes one row, dropped, as the target's package does)."""
        wanted = logit_idx if logit_idx.numel() else logit_idx.new_zeros(1)
        with forward_context(meta):
            logits, out = self._fn(ids, hidden, positions, wanted)
        return (logits if logit_idx.numel() else logits[:0]), out


def head_input_widths(drafter: DraftHead, target_config: Any) -> tuple[int, ...]:
    """The widths of the hidden states the head is fed: the target's features (catch-up) and
    its own output (chain steps)."""
    h = drafter.config.hidden_size
    layers = drafter.feature_layers
    target = target_config.hidden_size * (len(layers) if layers is not None else 1)
    return tuple(sorted({target, h}))


def head_compile_jobs(
    forward: CompilePlan, drafter: DraftHead, target_config: Any, installed: dict[int, Any]
) -> list[CompileJob]:
    """Packages for the head's steps beside the target's compiled forward `forward` (CPU
    packages only: on CUDA the head's chain replays a graph, chain_graphs.py), keyed and
    cached as the target's are; each loaded package goes into `installed[input width]`."""
    if not forward.enabled or forward.package is None:
        return []
    jobs = []
    linears = head_linears(drafter)
    for width in head_input_widths(drafter, target_config):
        step = HeadStep(drafter, width, linears)
        key = package_key(step, forward.max_tokens)
        plan = CompilePlan(
            True,
            "engine.compile (the EAGLE head)",
            Path(forward.package).parent / f"{key}.pt2",
            forward.max_tokens,
            role=f"EAGLE head ({width}-wide inputs)",
            loads_as=functools.partial(CompiledHead, linears=linears),
        )
        jobs.append(CompileJob(plan, functools.partial(installed.__setitem__, width), step))
    return jobs


def head_linears(drafter: DraftHead) -> HeadLinears:
    """What the head's package runs its linears on here: an fp32 head the few-row kernel where
    it builds (`cpu_linear.usable_for`), a bf16 head on a CPU 8-bit blocks where the block
    kernel loads (otherwise the reason is logged once), else inductor's GEMMs."""
    if cpu_linear.usable_for(drafter):
        return "packed"
    weight = next(drafter.parameters())
    if weight.device.type == "cpu" and weight.dtype in block_linear.MODEL_DTYPES:
        if block_linear.load():
            return "blocks"
    return "dense"
