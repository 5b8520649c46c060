"""The GGUF's own quantized weights for decode steps of a few rows on a CPU
(`engine.gguf_int4_decode`): its 4-bit linears and its Q8_0 LM head.

Why: a decode step of one to a few requests, or a verify of a few drafts, reads each weight for
a few rows, so on a CPU it waits on memory, not on arithmetic. The default model ships as a
Q4_1 GGUF: each linear is 4-bit integers with a scale and an offset per 32 weights (0.625 bytes
a weight), its LM head Q8_0 (1.06 bytes), which the loader expands to bf16 (2 bytes). Kept as
the file has them and run through the block-quantized kernel (block_linear.py), a step reads
~2.5x fewer bytes (docs/benchmarks.md, "The GGUF's quantized weights in few-row steps").

Exactness: a weight is w = u * d + m with u unsigned (Q4_1 as stored; Q4_0 w = (q - 8) d;
Q8_0 w = q d, kept as u = q + 128, m = -128 d): the file's weights exactly. Every weight taken
is checked against the dense weight the loader made from the same file (transformers' own
GGUF reading), so a name or a row order read wrong keeps that linear dense instead of serving
wrong weights. The kernel takes each row as a pair of int8 terms (block_linear.py), whose
fidelity is measured, not assumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sessionserve.replicas import block_linear
from sessionserve.replicas.block_linear import BLOCK, BlockLinear, BlockWeight, fits, pack

INT4_FORMAT = 2  # bump when what a packed weight holds changes (the package key has it)
# the largest step (tokens) the package runs where the kernel takes every row as int8 terms:
# past it the dense package's bf16 GEMMs on AMX tiles win (docs/benchmarks.md, stop 100)
MAX_TOKENS = 12
# ... and where it takes wide steps on AMX tiles itself (`block_linear.tile_rows`): a step's
# linears at 16 rows read 1.57x, 32 1.84x, 64 2.69x faster than as int8 terms; in process the
# steps of 10-48 requests read 1.04-1.33x the dense package, 64 1.00x (docs/benchmarks.md,
# stop 101)
MAX_TOKENS_ON_TILES = 48
# bytes of a block: Q4_1's fp16 d, fp16 m and 16 bytes of nibbles; Q4_0's d and nibbles;
# Q8_0's d and 32 bytes
BLOCK_BYTES = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}
BITS = {"Q4_1": 4, "Q4_0": 4, "Q8_0": 8}
# where a model's LM head may be in a GGUF: its own tensor, or the embedding it is tied to
HEAD_TENSORS = ("output.weight", "token_embd.weight")
log = logging.getLogger(__name__)


def unpack_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks [N, K / 32 * BLOCK_BYTES] -> u [N, K] int32 (unsigned:
    0..15, or 0..255 for Q8_0), and per block scale and offset [N, K / 32] float32 (w = u * d
    + m). Q4 nibbles as ggml stores them: byte j holds weight j (low) and j + 16 (high)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        u = blocks[..., 2:].copy().view(np.int8).astype(np.int32) + 128
        return u.reshape(n, -1), d, -128.0 * d
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        m = -8.0 * d
        nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.int32)
    return q.reshape(n, -1), d, m


def dequantized(u: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The weights [N, K] in fp32, as ggml's own dequantization computes them."""
    n, k = u.shape
    w = u.reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(n, k).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class BlockSummary:
    """What of a GGUF the kernel reads as stored (Q4_0, Q4_1, Q8_0)."""

    tensors: int  # how many tensors
    # of the decoder's linear weights (the file's 2-D `blk.*` tensors), the share stored so:
    # the default model's ~all, Gemma 3's Q4_K_M ~1.5% (its K-quants and Q5_0 stay dense;
    # its LM head, Q8_0, is read as stored)
    decoder_share: float

    @property
    def decoder_blocks(self) -> bool:
        """Whether the package's decoder linears are mostly the kernel's (it then reads each
        weight once for all of a step's rows), not only its LM head."""
        return self.decoder_share >= 0.5


def block_summary(gguf_path: Path, record: Path) -> BlockSummary:
    """`gguf_path`'s `BlockSummary`, kept in `record` (JSON) once read: gguf's reader takes
    seconds over a large vocabulary (Gemma 3's 262K tokens: ~10 s on 2 cores, one of them
    busy with a build), too long for every start."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return BlockSummary(**json.loads(record.read_text()))
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    blocks = [t for t in reader.tensors if t.tensor_type.name in BLOCK_BYTES]
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    total = sum(int(t.n_elements) for t in linears)
    stored = sum(int(t.n_elements) for t in linears if t.tensor_type.name in BLOCK_BYTES)
    summary = BlockSummary(len(blocks), stored / total if total else 0.0)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(f"{record.name}.{os.getpid()}")
    partial.write_text(json.dumps(dataclasses.asdict(summary)))
    partial.replace(record)  # whole or not at all, for a replica starting beside this one
    return summary


def _open(gguf_path: Path, config: Any) -> tuple[Any, Any, Any] | None:
    """The file's reader, gguf's tensor name map for its architecture and transformers'
    tensor processor for it (Llama's q/k permutation); None where gguf does not know it."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    arch_key = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_key is None:
        log.warning("gguf blocks: gguf does not know the architecture %r; none taken", arch)
        return None
    heads = config.num_attention_heads
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        }
    )
    return reader, gguf.get_tensor_name_map(arch_key, config.num_hidden_layers), processor


def _checked(tensor: Any, processor: Any, name: str, linear: torch.nn.Linear) -> BlockWeight | None:
    """`tensor` packed for the kernel where it is `linear`'s weight exactly (in the
    processor's row order); None, with a log line, where not."""
    kind = tensor.tensor_type.name
    if not fits(linear.out_features, linear.in_features):
        log.info(
            "gguf blocks: %s is [%d, %d], not whole records of the kernel; it stays dense",
            name,
            linear.out_features,
            linear.in_features,
        )
        return None
    rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
    u, d, m = unpack_blocks(np.ascontiguousarray(rows), kind)
    dense = linear.weight.detach()
    if u.shape != tuple(dense.shape) or not torch.equal(
        dequantized(u, d, m).to(dense.dtype), dense.cpu()
    ):
        log.warning(
            "gguf blocks: %s (%s) does not match the loaded weight of %s; it stays dense",
            tensor.name,
            kind,
            name,
        )
        return None
    return pack(u, d, m, BITS[kind])


def max_tokens() -> int:
    """The widest step the 4-bit package takes on this machine (loads the kernel first)."""
    tiles = block_linear.load() and block_linear.tile_rows() > 0
    return MAX_TOKENS_ON_TILES if tiles else MAX_TOKENS


def read_block_linears(
    gguf_path: Path,
    module: torch.nn.Module,
    prefix: str,
    config: Any,
    lm_head: torch.nn.Linear | None = None,
) -> dict[str, BlockWeight]:
    """The file's Q4_0 / Q4_1 / Q8_0 tensors that are weights of `module`'s `nn.Linear`
    modules, by the module's name in `module` ("layers.0.self_attn.q_proj"), each one checked
    equal to the module's dense weight (in its dtype); the others are left out with a log line.
    `prefix`: `module`'s own name in the transformers model ("model" for its decoder), whose
    full names gguf's name map knows; `config`: the model's config. With `lm_head`, also the
    LM head (its own tensor, or the embedding it is tied to), as "lm_head". Rows are reordered
    by transformers' tensor processor for the file's architecture, applied to whole blocks."""
    opened = _open(gguf_path, config)
    if opened is None:
        return {}
    reader, name_map, processor = opened
    tensors = {t.name: t for t in reader.tensors if t.tensor_type.name in BLOCK_BYTES}
    taken: dict[str, BlockWeight] = {}
    for name, child in module.named_modules():
        gguf_name = name_map.get_name(f"{prefix}.{name}" if prefix else name)
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if isinstance(child, torch.nn.Linear) and tensor is not None:
            if weight := _checked(tensor, processor, name, child):
                taken[name] = weight
    if lm_head is not None:
        head = next((tensors[n] for n in HEAD_TENSORS if n in tensors), None)
        if head is not None and (weight := _checked(head, processor, "lm_head", lm_head)):
            taken["lm_head"] = weight
    return taken


def swap_block_linears(module: torch.nn.Module, weights: dict[str, BlockWeight]) -> int:
    """Replace each `nn.Linear` among `module`'s descendants named in `weights` (names as in
    `module`) by a `BlockLinear`; how many were replaced. For the copy a package is exported
    from: the dense weights are dropped from it."""
    replaced = 0
    for name, child in list(module.named_modules()):
        weight = weights.get(name)
        if weight is None or not isinstance(child, torch.nn.Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, BlockLinear(weight, child.bias, child.weight.dtype))
        replaced += 1
    return replaced
