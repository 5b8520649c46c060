"""The few-row fp32 linear (`cpu_linear.cpp`): the GEMMs of the decode step and EAGLE head
packages on a CPU.

Why: a decode step of a small model on a CPU is its GEMMs, run at a few rows (the decoding
requests, a verify's k + 1 tokens each), where neither MKL nor inductor's GEMM template
reaches the cores' FMA rate (docs/benchmarks.md: SmolLM2-135M's linears at 8 rows, two Zen 3
cores, 65.7 ms through `F.linear`, 24.6 ms through this kernel). The model stays the
transformers class: `swap_linears` replaces its `nn.Linear` modules by `PackedLinear` in the
copy a package is exported from, so the package calls the kernel through its C function.
Built and loaded once per machine by `native_kernel.NativeKernel`; `SESSIONSERVE_CPU_LINEAR=0`
keeps inductor's GEMMs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sessionserve.replicas.native_kernel import NativeKernel, vector_lanes

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
DISABLE_ENV = "SESSIONSERVE_CPU_LINEAR"  # "0": the packages keep inductor's GEMMs
C_SHIM = (
    "AOTITorchError aoti_torch_cpu_cpu_linear(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, AtenTensorHandle*)"
)
log = logging.getLogger(__name__)


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::cpu_linear")
    def _(x, packed, bias):  # noqa: ANN001, ANN202
        return x.new_empty((*x.shape[:-1], packed.shape[0] * packed.shape[2]))


# the models whose packages run it (`usable_for`): a bf16 model's first start does not build it
MODEL_DTYPES = (torch.float32,)
KERNEL = NativeKernel(
    SOURCE,
    DISABLE_ENV,
    "the CPU few-row linear kernel",
    _register_fake,
    log,
    dtypes=MODEL_DTYPES,
)
# build (once per machine) and load the op; False, with the reason logged once and in
# `why_not()`, where it cannot be used here
load = KERNEL.load
why_not = KERNEL.why_not


def panel_width() -> int:
    """Output columns a packed panel holds on this CPU (one vector's lanes)."""
    return vector_lanes()


def fits(weight: torch.Tensor) -> bool:
    """An fp32 [N, K] weight whose N outputs fill whole panels here."""
    width = panel_width()
    return weight.dtype == torch.float32 and width > 0 and weight.shape[0] % width == 0


def supports(linear: torch.nn.Module) -> bool:
    """An `nn.Linear` whose weight `fits` (the others keep their GEMM)."""
    return type(linear) is torch.nn.Linear and fits(linear.weight)


def usable_for(model: torch.nn.Module) -> bool:
    """Whether `model`'s packages run the kernel: fp32 weights, at least one linear it
    supports, and the kernel built and loaded here (otherwise the reason is logged once)."""
    if next(model.parameters()).dtype not in MODEL_DTYPES:
        return False
    return any(supports(m) for m in model.modules()) and load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (an `nn.Linear`'s weight) -> [N / P, K, P]: panels of P output columns, K-major,
    as the kernel streams them."""
    n, k = weight.shape
    width = panel_width()
    if not fits(weight):
        raise ValueError(f"{n} {weight.dtype} outputs do not fill fp32 panels of {width} columns")
    return weight.detach().reshape(n // width, width, k).transpose(1, 2).contiguous()


class PackedLinear(torch.nn.Module):
    """`F.linear(x, weight, bias)` with the weight packed for `cpu_linear`: an `nn.Linear`'s
    inputs and outputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack(weight))
        bias = bias if bias is not None else torch.empty(0)
        self.register_buffer("bias", bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)  # loads the op in a build process


def swap_linears(module: torch.nn.Module) -> int:
    """Replace every supported `nn.Linear` among `module`'s descendants by a `PackedLinear`;
    how many were replaced. For the copy a package is exported from: the originals' weights
    are dropped from it."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if supports(child):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + b with W packed by `pack` (loads the op first)."""
    KERNEL.require()
    return torch.ops.sessionserve.cpu_linear(
        x, packed, bias if bias is not None else x.new_empty(0)
    )


def c_shims() -> dict[object, list[str]]:
    """The op's C function, for a package that calls it (as cpu_decode_kernel's); loads the
    op, raising where it cannot be used here."""
    KERNEL.require()
    return {torch.ops.sessionserve.cpu_linear.default: [C_SHIM]}


def key_fact() -> list[object]:
    """What a package built with the kernel depends on (its C function and its panels)."""
    return [C_SHIM, panel_width()]
