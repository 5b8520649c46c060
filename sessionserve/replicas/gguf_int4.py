"""The GGUF's own quantized weights for decode steps of a few rows on a CPU
(`engine.gguf_int4_decode`): its 4-bit linears and its Q8_0 LM head, and its other quantized
linears as blocks too.

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

The file's other quantized kinds: Q5_0 and Q5_1 are read as stored too, their 5-bit integers
in the 8-bit records (exact), and Q4_K, whose 32-weight sub-blocks each have a scale and an
offset (d x a 6-bit scale, dmin x a 6-bit min: exact in fp32; the records hold them in fp16,
2^-11 of each). Other K-quants (Q6_K: 16-weight sub-blocks; Q5_K, Q2_K, ...), which the
kernel's one scale and offset per 32 weights cannot hold as stored, are re-blocked from the
loaded weight as 8-bit blocks (`eight_bit_blocks`: u = round((w - min) / d), d = (max - min)
/ 255; each weight within d / 2 of the file's, against the 2^-9 relative rounding of the bf16
copy served otherwise).
Gemma 3's Q4_K_M file stores its decoder as Q5_0, Q4_K and Q6_K: without these its package
read only the LM head as blocks (docs/benchmarks.md, stop 109). Tensors the file stores
unquantized (F32, F16, BF16) stay dense: re-blocking them would serve less than the file.
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

from sessionserve.replicas.block_linear import BLOCK, BlockLinear, BlockWeight, fits, pack

INT4_FORMAT = 4  # bump when what a packed weight holds changes (the package key has it)
# the widest step (tokens) the 4-bit package runs. On AMX CPUs the kernel takes wide steps on
# tiles (`block_linear.tile_rows`): a step's linears at 16 rows read 1.57x, 32 1.84x, 64 2.69x
# faster than as int8 terms, and in process steps of 10-48 requests read 1.04-1.33x the dense
# package, 64 1.00x (docs/benchmarks.md, stop 101). Without tiles the rows are int8 terms,
# which past 12 rows lost to the dense package's bf16 GEMMs on an AMX box (stop 100), but on a
# CPU without AMX the dense side is the prefill package's slower GEMMs: on an Intel Xeon
# without AMX, Gemma 3's decode steps of 12-32 requests ran 1.8-2.3x faster in the 4-bit
# package than in the (fp32) prefill package (stop 113)
MAX_TOKENS = 48
# bytes of a ggml block (32 weights): Q4_1's fp16 d, fp16 m and 16 bytes of nibbles; Q4_0's d
# and nibbles; Q8_0's d and 32 bytes; Q5_0's d, 4 bytes of fifth bits and nibbles (Q5_1's with
# m); Q4_K's super-block of 256: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of
# nibbles
BLOCK_BYTES = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144}
# bits of the kernel's records a weight of each kind takes (5-bit integers in 8-bit records)
BITS = {"Q4_1": 4, "Q4_0": 4, "Q8_0": 8, "Q5_0": 8, "Q5_1": 8, "Q4_K": 4}
# kinds a GGUF stores unquantized: never re-blocked (`reblocks`)
UNQUANTIZED = frozenset({"F32", "F16", "BF16", "F64"})
# where a model's LM head may be in a GGUF: its own tensor, or the embedding it is tied to
HEAD_TENSORS = ("output.weight", "token_embd.weight")
log = logging.getLogger(__name__)


def unpack_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks [N, K / weights a block * BLOCK_BYTES] -> u [N, K] int32
    (unsigned: 0..15, 0..31 for Q5_0 / Q5_1, 0..255 for Q8_0), and per 32 weights scale and
    offset [N, K / 32] float32 (w = u * d + m, as ggml's own dequantization computes it).
    Nibbles as ggml stores them: byte j holds weight j (low) and j + 16 (high); Q5's fifth
    bits are a little-endian uint32, bit j weight j's. Q4_K's 32-weight sub-blocks have a
    scale (d x a 6-bit scale) and an offset (-dmin x a 6-bit min) each: exact in fp32, not
    always in the fp16 the kernel's records hold (`pack` rounds them: 2^-11 of each)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _unpack_q4_k(blocks)

    def fp16_at(offset: int) -> np.ndarray:
        return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    d = fp16_at(0)
    if kind == "Q8_0":
        u = blocks[..., 2:].copy().view(np.int8).astype(np.int32) + 128
        return u.reshape(n, -1), d, -128.0 * d
    offset = 4 if kind in ("Q4_1", "Q5_1") else 2
    m = fp16_at(2) if offset == 4 else (-16.0 if kind == "Q5_0" else -8.0) * d
    if kind in ("Q5_0", "Q5_1"):
        high = blocks[..., offset : offset + 4].copy().view("<u4")  # [N, blocks, 1]
        fifth = ((high >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int32) << 4
        offset += 4
    else:
        fifth = 0
    nibbles = blocks[..., offset:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.int32) | fifth
    return q.reshape(n, -1), d, m


def _unpack_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`unpack_blocks` for Q4_K super-blocks [N, S, 144]: sub-block j of 32 weights is
    w = (d sc_j) q - dmin m_j, its nibbles chunk j // 2's low (j even) or high halves; the
    6-bit scales and mins unpacked by gguf's own `Q4_K.get_scale_min`."""
    from gguf.quants import Q4_K

    n, supers = blocks.shape[:2]
    flat = blocks.reshape(n * supers, -1)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n * S, 1]
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(flat[:, 4:16].copy())  # [n * S, 8] each
    nibbles = flat[:, 16:].reshape(n * supers, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (nibbles & 0xF).reshape(n, -1).astype(np.int32)
    scale = (d * scales.astype(np.float32)).reshape(n, -1)
    offset = -(dmin * mins.astype(np.float32)).reshape(n, -1)
    return q, scale, offset


def reblocks(kind: str) -> bool:
    """Whether a tensor of this GGUF kind is re-blocked from the loaded weight
    (`eight_bit_blocks`): quantized, in a kind the kernel does not read as stored."""
    return kind not in BLOCK_BYTES and kind not in UNQUANTIZED


def eight_bit_blocks(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dense weight [N, K] as 8-bit blocks of 32: u [N, K] (0..255), d and m [N, K / 32]
    exact in fp16 as the records hold them, w ~ u * d + m with m the block's least weight
    (rounded down to fp16) and d its range / 255 (rounded up): each weight within d / 2 of
    `weight`'s, a block of one value exactly."""
    n, k = weight.shape
    w = weight.detach().cpu().double().numpy().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.min(-1), w.max(-1)
    m = _fp16_toward(lo, -np.inf)
    d = _fp16_toward((hi - m) / 255.0, np.inf)
    steps = np.divide(w - m[..., None], d[..., None], out=np.zeros_like(w), where=d[..., None] > 0)
    u = np.clip(np.rint(steps), 0, 255).astype(np.int32)
    return u.reshape(n, k), d.astype(np.float32), m.astype(np.float32)


def eight_bit_weight(weight: torch.Tensor) -> BlockWeight | None:
    """A dense weight no file holds as blocks (an EAGLE head's) as the kernel's 8-bit records
    (`eight_bit_blocks`); None where it does not fill whole records or its scales exceed
    fp16."""
    if not fits(*weight.shape):
        return None
    u, d, m = eight_bit_blocks(weight)
    return pack(u, d, m, 8) if _fp16_holds(d, m) else None


def _fp16_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """`x` rounded to fp16, then one fp16 step toward `direction` where that rounded the
    other way (float64 out: every fp16 value is exact in it)."""
    half = x.astype(np.float16)
    wrong = half < x if direction > 0 else half > x
    half = np.where(wrong, np.nextafter(half, np.float16(direction)), half)
    return half.astype(np.float64)


def dequantized(u: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The weights [N, K] in fp32, as ggml's own dequantization computes them."""
    n, k = u.shape
    w = u.reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(n, k).astype(np.float32))


# bump when what `BlockSummary` counts changes (a record of another format is read again)
SUMMARY_FORMAT = 2


@dataclasses.dataclass(frozen=True)
class BlockSummary:
    """What of a GGUF the package reads as blocks: as stored (the kinds of `BLOCK_BYTES`), or
    quantized in another kind and re-blocked (`reblocks`)."""

    tensors: int  # how many tensors
    # of the decoder's linear weights (the file's 2-D `blk.*` tensors), the share read as
    # blocks: the default model's ~all; Gemma 3's Q4_K_M all (Q5_0, Q4_K as stored, its Q6_K
    # re-blocked; its LM head, Q8_0, as stored)
    decoder_share: float
    format: int = 1  # SUMMARY_FORMAT where read now; a record of before it has none

    @property
    def decoder_blocks(self) -> bool:
        """Whether the package's decoder linears are mostly the kernel's (it then reads each
        weight once for all of a step's rows), not only its LM head."""
        return self.decoder_share >= 0.5


def _read_as_blocks(kind: str) -> bool:
    return kind in BLOCK_BYTES or reblocks(kind)


def block_summary(gguf_path: Path, record: Path) -> BlockSummary:
    """`gguf_path`'s `BlockSummary`, kept in `record` (JSON) once read: gguf's reader takes
    seconds over a large vocabulary (Gemma 3's 262K tokens: ~10 s on 2 cores, one of them
    busy with a build), too long for every start."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = BlockSummary(**json.loads(record.read_text()))
        if kept.format == SUMMARY_FORMAT:
            return kept
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    blocks = [t for t in reader.tensors if _read_as_blocks(t.tensor_type.name)]
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    total = sum(int(t.n_elements) for t in linears)
    taken = sum(int(t.n_elements) for t in linears if _read_as_blocks(t.tensor_type.name))
    summary = BlockSummary(len(blocks), taken / total if total else 0.0, SUMMARY_FORMAT)
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


def _fills_records(tensor: Any, name: str, linear: torch.nn.Linear) -> bool:
    """Whether `linear` (the file's `tensor`) fills whole records of the kernel; if not, a
    log line says it stays dense."""
    if fits(linear.out_features, linear.in_features):
        return True
    log.info(
        "gguf blocks: %s (%s) is [%d, %d] as %s, not whole records of the kernel; it stays dense",
        tensor.name,
        tensor.tensor_type.name,
        linear.out_features,
        linear.in_features,
        name,
    )
    return False


def _in_fp16(name: str, d: np.ndarray, m: np.ndarray) -> bool:
    """Whether the records' fp16 holds a weight's scales and offsets; if not, a log line says
    it stays dense."""
    if _fp16_holds(d, m):
        return True
    log.warning("gguf blocks: %s exceeds fp16's range; it stays dense", name)
    return False


def _fp16_holds(d: np.ndarray, m: np.ndarray) -> bool:
    """Whether the records' fp16 scales and offsets hold `d` and `m` (none overflows)."""
    return bool(np.isfinite(d.astype(np.float16)).all() and np.isfinite(m.astype(np.float16)).all())


def _checked(tensor: Any, processor: Any, name: str, linear: torch.nn.Linear) -> BlockWeight | None:
    """`tensor` packed for the kernel where it is `linear`'s weight exactly (in the
    processor's row order); None, with a log line, where not."""
    kind = tensor.tensor_type.name
    if not _fills_records(tensor, name, linear):
        return None
    rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
    u, d, m = unpack_blocks(np.ascontiguousarray(rows), kind)
    if not _in_fp16(name, d, m):
        return None
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


def _reblocked(tensor: Any, name: str, linear: torch.nn.Linear) -> BlockWeight | None:
    """`linear`'s weight (the file's `tensor`, dequantized by the loader) as 8-bit blocks;
    None, with a log line, where it does not fill the kernel's records or exceeds fp16."""
    if tensor.n_elements != linear.weight.numel():
        log.warning(
            "gguf blocks: %s has %d weights, the loaded %s %d; it stays dense",
            tensor.name,
            tensor.n_elements,
            name,
            linear.weight.numel(),
        )
        return None
    if not _fills_records(tensor, name, linear):
        return None
    u, d, m = eight_bit_blocks(linear.weight)
    return pack(u, d, m, 8) if _in_fp16(name, d, m) else None


def read_block_linears(
    gguf_path: Path,
    module: torch.nn.Module,
    prefix: str,
    config: Any,
    lm_head: torch.nn.Linear | None = None,
) -> dict[str, BlockWeight]:
    """The file's quantized tensors that are weights of `module`'s `nn.Linear` modules, by
    the module's name in `module` ("layers.0.self_attn.q_proj"): those of the kinds the kernel
    reads as stored, each one checked equal to the module's dense weight (in its dtype; one
    that differs is left out with a log line), and those of other quantized kinds re-blocked
    from the module's weight (`eight_bit_blocks`). `prefix`: `module`'s own name in the
    transformers model ("model" for its decoder), whose full names gguf's name map knows;
    `config`: the model's config. With `lm_head`, also the LM head (its own tensor, or the
    embedding it is tied to), as "lm_head". Rows are reordered by transformers' tensor
    processor for the file's architecture, applied to whole blocks."""
    opened = _open(gguf_path, config)
    if opened is None:
        return {}
    reader, name_map, processor = opened
    tensors = {t.name: t for t in reader.tensors if _read_as_blocks(t.tensor_type.name)}
    taken: dict[str, BlockWeight] = {}
    reblocked: dict[str, int] = {}  # kind -> linears re-blocked

    def take(name: str, tensor: Any, linear: torch.nn.Linear) -> None:
        kind = tensor.tensor_type.name
        if reblocks(kind):
            weight = _reblocked(tensor, name, linear)
            reblocked[kind] = reblocked.get(kind, 0) + (weight is not None)
        else:
            weight = _checked(tensor, processor, name, linear)
        if weight is not None:
            taken[name] = weight

    for name, child in module.named_modules():
        gguf_name = name_map.get_name(f"{prefix}.{name}" if prefix else name)
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if isinstance(child, torch.nn.Linear) and tensor is not None:
            take(name, tensor, child)
    if lm_head is not None:
        head = next((tensors[n] for n in HEAD_TENSORS if n in tensors), None)
        if head is not None:
            take("lm_head", head, lm_head)
    if reblocked:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(reblocked.items()))
        log.info("gguf blocks: linears re-blocked as 8-bit from the loaded weights: %s", counts)
    return taken


def block_head(gguf_path: Path, model: Any) -> BlockLinear | None:
    """`model`'s LM head as the file's blocks (its own tensor, or the embedding it is tied
    to; checked against the loaded weight as `read_block_linears` checks), for a package
    whose other linears stay dense (the prefill package's: one or a few rows of logits a
    step, which read the whole head); None where the file's head is not blocks the kernel
    reads, or differs from the loaded one."""
    head = model.get_output_embeddings()
    weight = read_block_linears(gguf_path, torch.nn.Module(), "", model.config, head).get("lm_head")
    if weight is None:
        return None
    return BlockLinear(weight, head.bias, head.weight.dtype)


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
