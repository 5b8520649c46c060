"""The block-quantized linear (`block_linear.cpp`): a GGUF's Q4_0 / Q4_1 / Q8_0 weights as the
file stores them (Q4_K's sub-blocks too; Q5 and re-blocked K-quants in 8-bit records), against rows
taken per block of 32 as two int8 terms, on AVX-512 VNNI; on CPUs with AMX, from `tile_rows()`
bf16 rows on, each record expanded once to bf16 on tiles.

Why: decode steps and verifies of a few rows read every weight for a few rows, so on a CPU
they wait on memory; the file's blocks are 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight against
bf16's 2. Torch's int4 GEMM took them only at up to 4 rows (it unpacks again for every 4) and
not Q8_0 at all (docs/benchmarks.md). This kernel unpacks each weight once for all the rows and
multiplies 64 pairs an instruction. ggml's CPU backend takes a row's block as one int8 term;
here a second term holds its residual, because one cost this model 5 points of top-1
agreement with the file's exact weights (`benchmarks/int4_decode.py --fidelity`).
Built and loaded once per machine by `native_kernel.NativeKernel`;
`SESSIONSERVE_BLOCK_LINEAR=0` turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sessionserve.replicas.native_kernel import NativeKernel, needs_avx512

SOURCE = Path(__file__).with_name("block_linear.cpp")
DISABLE_ENV = "SESSIONSERVE_BLOCK_LINEAR"  # "0": the kernel is not used
# the fewest bf16 rows taken on AMX tiles, read when the op loads ("0": never; default 10)
TILE_ROWS_ENV = "SESSIONSERVE_BLOCK_TILE_ROWS"
C_SHIM = (
    "AOTITorchError aoti_torch_cpu_block_linear(AtenTensorHandle, AtenTensorHandle, int64_t, "
    "AtenTensorHandle*)"
)
BLOCK = 32  # weights per scale; activations per int8 scale
PANEL = 16  # outputs a record holds
SCALE_BYTES = 64  # a record's d and m, fp16, for its 16 outputs
log = logging.getLogger(__name__)


def record_bytes(bits: int) -> int:
    return SCALE_BYTES + PANEL * BLOCK * bits // 8


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::block_linear")
    def _(x, records, bits):  # noqa: ANN001, ANN202
        return x.new_empty((*x.shape[:-1], records.shape[0] * PANEL))


_needs = needs_avx512("AVX-512 VNNI", "_is_vnni_supported")
# the models whose packages run it: the 4-bit package serves bf16 models only (its int8 pairs
# hold a row about as finely as bf16, not as fp32; compiled_decode.plan_int4_decode_compile),
# so an fp32 model's first start does not build it
MODEL_DTYPES = (torch.bfloat16,)


KERNEL = NativeKernel(
    SOURCE,
    DISABLE_ENV,
    "the CPU block-quantized linear kernel",
    _register_fake,
    log,
    extra_flags=("-mavx512vnni",),
    needs=_needs,
    dtypes=MODEL_DTYPES,
)
# build (once per machine) and load the op; False, with the reason logged once and in
# `why_not()`, where it cannot be used here
load = KERNEL.load
why_not = KERNEL.why_not


@dataclass(frozen=True)
class BlockWeight:
    """One linear's weight as the kernel streams it: `records` [N / 16, K / 32, bytes] uint8
    (`pack`), with `bits` (4 or 8) a weight."""

    records: torch.Tensor
    bits: int

    @property
    def out_features(self) -> int:
        return self.records.shape[0] * PANEL

    @property
    def in_features(self) -> int:
        return self.records.shape[1] * BLOCK


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape fills whole records."""
    return out_features % PANEL == 0 and in_features % BLOCK == 0


def pack(u: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int) -> BlockWeight:
    """w = u * d + m: u [N, K] unsigned (0..15 for 4 bits, 0..255 for 8), d and m [N, K / 32]
    (exact in fp16, as a GGUF stores them) -> the kernel's records (block_linear.cpp)."""
    n, k = u.shape
    if not fits(n, k) or bits not in (4, 8):
        raise ValueError(f"a [{n}, {k}] weight of {bits} bits does not fill whole records")
    panels, blocks = n // PANEL, k // BLOCK
    # [panel, block, output j, k in block]
    ub = u.astype(np.uint8).reshape(panels, PANEL, blocks, BLOCK).transpose(0, 2, 1, 3)
    if bits == 4:
        # vector t's byte 4 j + i: output j's weight k = 4 t + i (low nibble) and k = 16 +
        # 4 t + i (high), laid out as [panel, block, t, j, i]
        low = ub[..., :16].reshape(panels, blocks, PANEL, 4, 4).transpose(0, 1, 3, 2, 4)
        high = ub[..., 16:].reshape(panels, blocks, PANEL, 4, 4).transpose(0, 1, 3, 2, 4)
        weights = (low | (high << 4)).reshape(panels, blocks, -1)
    else:  # vector g's byte 4 j + i: output j's weight k = 4 g + i
        weights = ub.reshape(panels, blocks, PANEL, 8, 4).transpose(0, 1, 3, 2, 4)
        weights = weights.reshape(panels, blocks, -1)

    def by_record(v: np.ndarray) -> np.ndarray:  # [N, blocks] -> [panel, block, 16] fp16
        return v.astype(np.float16).reshape(panels, PANEL, blocks).transpose(0, 2, 1)

    scales = np.ascontiguousarray(np.concatenate([by_record(d), by_record(m)], axis=-1))
    scales = scales.view(np.uint8)
    records = np.ascontiguousarray(np.concatenate([scales, weights], axis=-1))
    return BlockWeight(torch.from_numpy(records), bits)


def tile_rows() -> int:
    """The fewest bf16 rows the kernel takes on AMX tiles (the dense bf16 arithmetic on the
    file's weights, see `reference`); 0 where it never does (no AMX, or `TILE_ROWS_ENV` 0)."""
    KERNEL.require()
    return int(torch.ops.sessionserve.block_linear_tile_rows())


def set_tile_rows(rows: int) -> int:
    """Take bf16 rows on tiles from `rows` on (0: never) in this process, for benchmarks and
    tests that compare the two paths; returns what holds (0 without AMX)."""
    KERNEL.require()
    return int(torch.ops.sessionserve.block_linear_set_tile_rows(rows))


def uses_tiles(x: torch.Tensor) -> bool:
    """Whether the kernel takes these rows on AMX tiles rather than as two int8 terms."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    least = tile_rows()
    return x.dtype == torch.bfloat16 and least > 0 and rows >= least


def linear(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """x @ W^T (loads the op first); the result in x's dtype."""
    KERNEL.require()
    return torch.ops.sessionserve.block_linear(x, weight.records, weight.bits)


def reference(x: torch.Tensor, u: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The kernel's arithmetic in float64 (for tests), as it takes these rows (`uses_tiles`):
    on tiles, w = u d + m rounded once to bf16 times the bf16 rows (a bf16 linear's); otherwise
    each block of 32 of x's rows as two int8 terms (dx = max|x| / 127, c = round(x / dx), then
    the residual on a grid of dx / 254, both rounded to nearest even), the dots exact,
    w = u d + m."""
    if uses_tiles(x):
        w = torch.from_numpy(u.astype(np.float32)).reshape(u.shape[0], -1, BLOCK)
        scale = torch.from_numpy(d.astype(np.float16).astype(np.float32))[..., None]
        shift = torch.from_numpy(m.astype(np.float16).astype(np.float32))[..., None]
        w = (w * scale + shift).reshape(u.shape).bfloat16()  # fp32's u d + m, then bf16
        return (x.double() @ w.double().T).reshape(*x.shape[:-1], u.shape[0])
    rows = x.reshape(-1, x.shape[-1]).float()
    blocks = rows.reshape(rows.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    positive = amax > 0
    inverse = torch.where(positive, 127.0 / amax, torch.zeros_like(amax))
    fine = torch.where(positive, 254.0 * 127.0 / amax, torch.zeros_like(amax))
    dx = amax / 127.0
    coarse = torch.round(blocks * inverse)
    # the kernel's fused multiply-add rounds x - c dx once: exact in float64, then to fp32
    residual = (blocks.double() - coarse.double() * dx.double()).float()
    residual = torch.round(residual * fine)
    xq = coarse.double() + residual.double() / 254.0  # x in units of dx
    sums = blocks.double().sum(-1)  # [M, blocks]
    ut = torch.from_numpy(u.astype(np.float64)).reshape(u.shape[0], -1, BLOCK)  # [N, b, 32]
    dots = torch.einsum("mbk,nbk->mnb", xq, ut)
    dt = torch.from_numpy(d.astype(np.float16).astype(np.float64))
    mt = torch.from_numpy(m.astype(np.float16).astype(np.float64))
    y = (dots * dt[None] * dx.double()[:, None, :, 0]).sum(-1) + sums @ mt.T
    return y.reshape(*x.shape[:-1], u.shape[0])


class BlockLinear(torch.nn.Module):
    """`F.linear(x, W, b)` with W in the kernel's records: an `nn.Linear`'s inputs and
    outputs."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = weight.out_features
        self.in_features = weight.in_features
        self.bits = weight.bits
        self.register_buffer("records", weight.records)
        self.register_buffer("bias", bias.detach().to(dtype) if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, BlockWeight(self.records, self.bits))
        return y + self.bias if self.bias is not None else y


def c_shims() -> dict[object, list[str]]:
    """The op's C function, for a package that calls it; loads the op, raising where it
    cannot be used here."""
    KERNEL.require()
    return {torch.ops.sessionserve.block_linear.default: [C_SHIM]}


def key_fact() -> list[object]:
    """What a package built with the kernel depends on (its C function and its records)."""
    return [C_SHIM, PANEL, BLOCK, SCALE_BYTES]
