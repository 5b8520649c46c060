"""The GGUF's own 4-bit linears for decode steps of a few rows on a CPU
(`engine.gguf_int4_decode`).

Why: a decode step of one to a few requests reads each weight for one to a few rows, so on a
CPU it waits on memory, not on arithmetic. The default model ships as a Q4_1 GGUF: each linear
is 4-bit integers with a scale and an offset per 32 weights, which the loader expands to bf16
(2 bytes a weight). Kept as the file has them (0.625 bytes a weight with their scales) and run
through torch's int4 weight-only GEMM (`aten._weight_int4pack_mm_for_cpu`, the CPU path of
gpt-fast and torchao; inductor keeps it inside the package), a step of 1-4 rows reads ~2.5x
fewer bytes (docs/benchmarks.md, "The GGUF's 4-bit weights in few-row decode steps").

Exactness: Q4_1 is w = q * d + m (Q4_0: w = (q - 8) * d), q in 0..15; torch's kernel computes
w = (q - 8) * scale + zero, so scale = d and zero = m + 8 d give the file's weights exactly in
fp32. The package computes in bf16 as the dense one does: scale and zero are rounded to bf16
there, as the dense weights are. Every weight taken is checked against the dense weight the
loader made from the same file (transformers' own GGUF reading), so a name or a row order
read wrong keeps that linear dense instead of serving wrong weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GROUP = 32  # weights per scale in Q4_0 / Q4_1 blocks, and torch's group size here
PANEL = 16  # torch's int4 packing takes outputs in multiples of this
INT4_FORMAT = 1  # bump when what a packed weight holds changes (the package key has it)
# the largest step (tokens) the 4-bit package runs: torch's kernel unpacks the weights again
# for every 4 rows, so past a few rows the dense package's GEMMs win (docs/benchmarks.md)
MAX_TOKENS = 4
# bytes of a block: Q4_1's fp16 d, fp16 m and 16 bytes of nibbles; Q4_0's d and nibbles
BLOCK_BYTES = {"Q4_1": 20, "Q4_0": 18}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int4Weight:
    """One linear's weight as `aten._weight_int4pack_mm_for_cpu` takes it: `packed` [N, K / 2]
    uint8 (`_convert_weight_to_int4pack_for_cpu`), `scales_zeros` [K / GROUP, N, 2] float32
    (cast to the activations' dtype where it is used)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor


class Int4Linear(torch.nn.Module):
    """`F.linear(x, W, b)` with W in torch's int4 layout: an `nn.Linear`'s inputs and outputs."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = weight.scales_zeros.shape[1]
        self.in_features = weight.scales_zeros.shape[0] * GROUP
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales_zeros", weight.scales_zeros.to(dtype))
        self.register_buffer("bias", bias.detach().to(dtype) if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def unpack_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks [N, K / 32 * BLOCK_BYTES] -> q [N, K] int32 (0..15), and
    per block scale and offset [N, K / 32] float32 (w = q * d + m; Q4_0 has m = -8 d).
    Nibbles as ggml stores them: byte j holds weight j (low) and j + 16 (high)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        m = -8.0 * d
        nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.int32)
    return q.reshape(n, -1), d, m


def to_int4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> Int4Weight:
    """q [N, K], d and m [N, K / GROUP] -> torch's layout: w = (q - 8) * d + (m + 8 d)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 1)
    scales_zeros = torch.stack([torch.from_numpy(d), torch.from_numpy(m + 8.0 * d)], dim=-1)
    return Int4Weight(packed, scales_zeros.transpose(0, 1).contiguous())


def dequantized(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The weights [N, K] in fp32, as ggml's own dequantization computes them."""
    n, k = q.shape
    w = q.reshape(n, k // GROUP, GROUP) * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(n, k).astype(np.float32))


def four_bit_tensors(gguf_path: Path) -> list[str]:
    """Names of the file's tensors stored as Q4_0 or Q4_1 (what this module can keep)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return [t.name for t in reader.tensors if t.tensor_type.name in BLOCK_BYTES]


def read_int4_linears(
    gguf_path: Path, module: torch.nn.Module, prefix: str, config: Any
) -> dict[str, Int4Weight]:
    """The file's Q4_0 / Q4_1 tensors that are weights of `module`'s `nn.Linear` modules, by
    the module's name in `module` ("layers.0.self_attn.q_proj"), each one checked equal to
    the module's dense weight (in its dtype); the others are left out with a log line.
    `prefix`: `module`'s own name in the transformers model ("model" for its decoder), whose
    full names gguf's name map knows; `config`: the model's config. Rows are reordered by
    transformers' tensor processor for the file's architecture (Llama's q/k permutation),
    applied to whole blocks."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    arch_key = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_key is None:
        log.warning("gguf int4: gguf does not know the architecture %r; none taken", arch)
        return {}
    name_map = gguf.get_tensor_name_map(arch_key, config.num_hidden_layers)
    heads = config.num_attention_heads
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        }
    )
    linears: dict[str, tuple[str, torch.nn.Linear]] = {}
    for name, child in module.named_modules():
        gguf_name = name_map.get_name(f"{prefix}.{name}" if prefix else name)
        if isinstance(child, torch.nn.Linear) and gguf_name is not None:
            linears[f"{gguf_name}.weight"] = (name, child)
    taken: dict[str, Int4Weight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name, linear = linears.get(tensor.name, ("", None))
        if kind not in BLOCK_BYTES or linear is None:
            continue
        if linear.out_features % PANEL:
            log.info(
                "gguf int4: %s has %d outputs, not a multiple of %d; it stays dense",
                name,
                linear.out_features,
                PANEL,
            )
            continue
        rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        q, d, m = unpack_blocks(np.ascontiguousarray(rows), kind)
        dense = linear.weight.detach()
        if q.shape != tuple(dense.shape) or not torch.equal(
            dequantized(q, d, m).to(dense.dtype), dense.cpu()
        ):
            log.warning(
                "gguf int4: %s (%s) does not match the loaded weight of %s; it stays dense",
                tensor.name,
                kind,
                name,
            )
            continue
        taken[name] = to_int4(q, d, m)
    return taken


def swap_int4_linears(module: torch.nn.Module, weights: dict[str, Int4Weight]) -> int:
    """Replace each `nn.Linear` among `module`'s descendants named in `weights` (names as in
    `module`) by an `Int4Linear`; how many were replaced. For the copy a package is exported
    from: the dense weights are dropped from it."""
    replaced = 0
    for name, child in list(module.named_modules()):
        weight = weights.get(name)
        if weight is None or not isinstance(child, torch.nn.Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Int4Linear(weight, child.bias, child.weight.dtype))
        replaced += 1
    return replaced
