"""The hand-written CPU decode attention (`cpu_decode_attention.cpp`): built once per machine,
loaded as the op `torch.ops.sessionserve.decode_attend`.

Why it exists: the decode step package (compiled_decode.py) had its attention compiled by
inductor from `inplace_decode.decode_attention`, which over multi-turn contexts took 40-50% of a
step; no formulation inductor compiles did better (docs/benchmarks.md, stop 57). The kernel
computes the same thing (the row's own new token included) in one pass per block of 16 tokens (8
on AVX2). It needs an x86 CPU with AVX-512 or AVX2 (built for the wider one it has) and a C++
compiler, as inductor's CPU backend does; where either is missing, or the build fails, `load()`
says why once and callers keep the compiled formula. The shared library is cached under the
cache root (`kernels/`), keyed by the source, torch's version and the flags, so a restart does
not rebuild it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from sessionserve.replicas.loader import cache_root

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # what the kernel is instantiated for
MAX_GROUP = 32  # query heads per KV head, times the query tokens per row
DTYPES = (torch.float32, torch.bfloat16)  # the pool's
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma")
# torch's CPU capability -> the kernel's vector code (the .cpp's primitives); AMX has AVX-512
ISA_FLAGS = {"AMX": AVX512_FLAGS, "AVX512": AVX512_FLAGS, "AVX2": ("-mavx2", "-mfma")}
DISABLE_ENV = "SESSIONSERVE_CPU_DECODE_KERNEL"  # "0": keep inductor's formula everywhere
log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "loaded": bool, "why": the reason it is not


def load() -> bool:
    """Build (once per machine) and load the op; False, with the reason logged once and in
    `why_not()`, where it cannot be used here."""
    with _lock:
        if "loaded" not in _state:
            why = _unavailable() or _build_and_load()
            _state["loaded"], _state["why"] = not why, why
            if why:
                log.warning("CPU decode attention kernel not used: %s", why)
        return bool(_state["loaded"])


def why_not() -> str:
    """Why `load()` returned False ('' when it did not, or was not called)."""
    return str(_state.get("why", ""))


def supports(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether a model with this attention layout can use the kernel (once it is loaded)."""
    return (
        head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and dtype in DTYPES
    )


def usable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """`supports` the layout and `load()`s here (built first if needed)."""
    return supports(head_dim, heads, kv_heads, dtype) and load()


def max_query_tokens(heads: int, kv_heads: int) -> int:
    """How many query tokens a row may have (a chain verify's k + 1)."""
    return MAX_GROUP // (heads // kv_heads)


def decode_attend(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`inplace_decode.decode_attention` for rows of T query tokens (query [B * T, H, D],
    a row's tokens consecutive; T = 1 for decode, k + 1 for a chain verify), each token
    seeing its row's context (slots [B, W], lens [B]; pools [S, KVH, D]) and its row's tokens
    up to itself: their K/V `new_key`, `new_value` [B * T, KVH, D] after the row's lens[b]
    slots, or, given empty, the row's last T context slots. Loads the op first if this
    process has not (a package's build process, tests)."""
    if not load():
        raise RuntimeError(f"the CPU decode attention kernel is not available: {why_not()}")
    return torch.ops.sessionserve.decode_attend(
        query, k_pool, v_pool, slots, lens, new_key, new_value, scale
    )


C_SHIM = (
    "AOTITorchError aoti_torch_cpu_decode_attend(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
    "double, AtenTensorHandle*)"
)


def aot_configs() -> dict[str, object]:
    """Inductor configs for a package that calls the op: through its C function, declared
    here (AOTInductor would otherwise route a custom op through a proxy executor, which a
    package run from its C entry points does not have). The op must be loaded."""
    op = torch.ops.sessionserve.decode_attend.default
    return {"aot_inductor.custom_ops_to_c_shims": {op: [C_SHIM]}}


def over_the_pool(scale: float) -> Callable[..., torch.Tensor]:
    """The kernel called as `inplace_decode.DecodeKernel` calls a kernel: (query, k_pool,
    v_pool, slots, lens), every row's new tokens the last of its context already (the torch
    backend's decode and chain-verify rows, whose K/V were written before the layer
    attends)."""

    def run(query, k_pool, v_pool, slots, lens):  # noqa: ANN001, ANN202 - as DecodeKernel
        none = query.new_empty(0)
        return decode_attend(query, k_pool, v_pool, slots, lens, none, none, scale)

    return run


def _unavailable() -> str:
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ISA_FLAGS:
        return f"the CPU's vector capability is {capability}, the kernel needs AVX512 or AVX2"
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()!r}; set CXX)"
    return ""


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build_and_load() -> str:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [
        _compiler(),
        *FLAGS,
        *ISA_FLAGS[torch.backends.cpu.get_cpu_capability()],
        abi,
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(SOURCE),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(" ".join([torch.__version__, *command[1:]]).encode())
    library = cache_root() / "kernels" / f"cpu_decode_attention-{key.hexdigest()[:16]}.so"

    def build() -> None:
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            done = subprocess.run(
                [*command, "-o", str(built)], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"its build failed: {done.stderr.strip()[-2000:]}")
            os.replace(built, library)

    # imported here: compiled_forward imports the attention package, which imports this
    from sessionserve.replicas.compiled_forward import build_once

    try:
        build_once(
            library,
            build,
            "building the CPU decode attention kernel (once per machine, ~15 s)",
            log,
        )
    except (RuntimeError, OSError) as error:
        return str(error)
    try:
        # global: an AOTInductor package calls the kernel's C shim by name (aot_configs)
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
        torch.ops.load_library(str(library))
    except OSError as error:
        return f"loading {library} failed: {error}"
    _register_fake()
    return ""


def _register_fake() -> None:
    @torch.library.register_fake("sessionserve::decode_attend")
    def _(query, k_pool, v_pool, slots, lens, new_key, new_value, scale):  # noqa: ANN001, ANN202
        return torch.empty_like(query)
