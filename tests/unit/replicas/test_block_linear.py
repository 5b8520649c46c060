"""The block-quantized linear kernel (block_linear.cpp): for 4- and 8-bit records, any number of
rows (within a pass, several passes, uneven splits), bf16 and fp32 inputs, it computes what its
stated arithmetic says (`block_linear.reference`, in float64); that arithmetic holds a row
about as finely as bf16 does; and a weight it was not packed for is refused with a message
that says what to change. Skipped where the CPU lacks AVX-512 VNNI (the kernel's reason),
except the check that says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sessionserve.replicas import block_linear, gguf_int4

needs_kernel = pytest.mark.skipif(
    not block_linear.load(), reason=f"the block kernel cannot run here: {block_linear.why_not()}"
)


def random_weight(rng, n: int, k: int, bits: int) -> tuple[np.ndarray, ...]:
    """u, d, m as a GGUF holds them (d, m exact in fp16; m < 0 as Q4_0 / Q8_0 have it)."""
    u = rng.integers(0, 2**bits, size=(n, k))
    d = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32)) * 2**bits * d / 2).astype(np.float16).astype(np.float32)
    return u, d, m


def exact(x: torch.Tensor, u: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    return x.double() @ gguf_int4.dequantized(u, d, m).double().T


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_the_kernel_computes_its_stated_arithmetic(bits, rows) -> None:
    rng = np.random.default_rng(rows * 10 + bits)
    u, d, m = random_weight(rng, 48, 96, bits)
    weight = block_linear.pack(u, d, m, bits)
    assert weight.records.shape == (3, 3, block_linear.record_bytes(bits))
    x = torch.from_numpy(rng.normal(0, 1, (rows, 96)).astype(np.float32))
    x[0, 32:64] = 0.0  # a block of zeros: no scale to divide by
    got = block_linear.linear(x, weight)
    want = block_linear.reference(x, u, d, m)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
def test_bf16_rows_leading_dims_and_a_bias() -> None:
    rng = np.random.default_rng(5)
    u, d, m = random_weight(rng, 32, 64, 4)
    bias = torch.randn(32)
    layer = block_linear.BlockLinear(block_linear.pack(u, d, m, 4), bias, torch.bfloat16)
    x = torch.randn(2, 3, 64).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 32)
    want = block_linear.reference(x, u, d, m) + bias.bfloat16().double()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_held_about_as_finely_as_bf16(bits) -> None:
    """Each block of a row as two int8 terms (a coarse one and its residual): the outputs' error
    against the exact product is below that of rounding the row to bf16 first, even with an
    outlier per block (which the coarse term's scale follows)."""
    rng = np.random.default_rng(7)
    u, d, m = random_weight(rng, 64, 256, bits)
    x = torch.from_numpy(rng.normal(0, 1, (8, 256)).astype(np.float32))
    x[:, ::32] *= 20.0  # an outlier in every block
    want = exact(x, u, d, m)
    ours = (block_linear.linear(x, block_linear.pack(u, d, m, bits)).double() - want).abs()
    bf16 = (exact(x.bfloat16().float(), u, d, m) - want).abs()
    assert ours.mean() < bf16.mean() and ours.max() < bf16.max()


needs_tiles = pytest.mark.skipif(
    not block_linear.load() or block_linear.tile_rows() == 0,
    reason="no AMX tiles here (or SESSIONSERVE_BLOCK_TILE_ROWS=0)",
)


@pytest.fixture
def tiles_from():
    """Set the fewest rows on tiles for a test; put back what held before."""
    before = block_linear.tile_rows()
    yield block_linear.set_tile_rows
    block_linear.set_tile_rows(before)


@needs_tiles
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 10, 17, 40, 64, 65, 130])
def test_bf16_rows_on_tiles_compute_a_bf16_linear_of_the_files_weights(
    bits, rows, tiles_from
) -> None:
    """On AMX tiles each record is expanded to bf16 (fp32's u d + m, rounded to nearest even)
    and multiplied with the bf16 rows, summed in fp32: within one rounding of the output to
    bf16 of the float64 product. 1 to 4 row tiles a pass, several passes, a ragged last
    tile; from 1 row when told to, and from `tile_rows()` rows unless told otherwise."""
    rng = np.random.default_rng(rows * 10 + bits)
    u, d, m = random_weight(rng, 48, 576, bits)
    weight = block_linear.pack(u, d, m, bits)
    x = torch.from_numpy(rng.normal(0, 1, (rows, 576)).astype(np.float32)).bfloat16()
    x[0, 32:64] = 0.0
    tiles_from(1)
    assert block_linear.uses_tiles(x)
    got = block_linear.linear(x, weight)
    w = gguf_int4.dequantized(u, d, m).bfloat16().double()
    want = x.double() @ w.T
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4)
    torch.testing.assert_close(want, block_linear.reference(x, u, d, m))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    tiles_from(0)  # the same rows as two int8 terms: a different arithmetic, not the same bits
    assert not block_linear.uses_tiles(x)
    terms = block_linear.linear(x, weight)
    torch.testing.assert_close(
        terms.double(), block_linear.reference(x, u, d, m), rtol=1e-2, atol=1e-2
    )


@needs_tiles
def test_which_rows_take_the_tiles(tiles_from) -> None:
    """bf16 rows from `tile_rows()` on; fp32 rows never (a bf16 product would not hold them);
    a negative setting is refused with what to give."""
    default = block_linear.tile_rows()
    assert 1 < default <= 16
    bf16 = torch.zeros(default, 64, dtype=torch.bfloat16)
    assert block_linear.uses_tiles(bf16) and not block_linear.uses_tiles(bf16[1:])
    assert not block_linear.uses_tiles(bf16.float())
    rng = np.random.default_rng(11)
    u, d, m = random_weight(rng, 32, 64, 4)
    x = torch.from_numpy(rng.normal(0, 1, (default, 64)).astype(np.float32))
    got = block_linear.linear(x, block_linear.pack(u, d, m, 4))
    want = block_linear.reference(x, u, d, m)  # the int8 terms': fp32 to within 1e-5
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert tiles_from(3) == 3 and block_linear.tile_rows() == 3
    with pytest.raises(RuntimeError, match="the fewest rows for the tiles is >= 0, got -1"):
        tiles_from(-1)


@needs_kernel
def test_a_weight_it_was_not_packed_for_is_refused() -> None:
    rng = np.random.default_rng(9)
    u, d, m = random_weight(rng, 32, 64, 4)
    with pytest.raises(ValueError, match="does not fill whole records"):
        block_linear.pack(u[:24], d[:24], m[:24], 4)
    weight = block_linear.pack(u, d, m, 4)
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        block_linear.linear(torch.randn(2, 96), weight)
    with pytest.raises(RuntimeError, match="must be packed by block_linear.pack"):
        torch.ops.sessionserve.block_linear(torch.randn(2, 64), weight.records, 8)


def test_a_cpu_without_vnni_is_told_why(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert "needs AVX-512 VNNI" in block_linear._needs()
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert block_linear._needs() == "it needs AVX-512 VNNI; this CPU's vector capability is AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AMX")
    assert block_linear._needs() == ""
