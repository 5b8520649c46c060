"""Hand-written C++ kernels for x86 CPUs, built once per machine and loaded as torch ops.

Why one builder: each kernel (the decode attention, the few-row linear, sampling's scans) is a
.cpp compiled against this torch for the widest vector ISA the CPU has, cached under the cache
root (`kernels/`) keyed by its source, the headers it includes, torch's version and the flags,
so a restart does not rebuild it; where the CPU, the compiler or the build falls short,
`load()` says why once and callers keep what inductor compiles. AOTInductor packages call a
kernel through its C function ("C shim"), found by name in the process: so the library is
loaded globally.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from sessionserve.replicas.build_lock import build_once
from sessionserve.replicas.loader import cache_root

FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma")
# torch's CPU capability -> the kernels' vector code; AMX has AVX-512
ISA_FLAGS = {"AMX": AVX512_FLAGS, "AVX512": AVX512_FLAGS, "AVX2": ("-mavx2", "-mfma")}
# the inductor config naming the C functions a package calls its kernels through
SHIMS_CONFIG = "aot_inductor.custom_ops_to_c_shims"


def vector_lanes() -> int:
    """fp32 lanes of the vectors the kernels are built for here (0: they cannot be)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return 16 if capability in ("AMX", "AVX512") else 8 if capability == "AVX2" else 0


KERNELS: list[NativeKernel] = []  # every kernel defined in this process (`prefetch`)


def prefetch(dtype: torch.dtype | None = None) -> list[threading.Thread]:
    """Build and load every kernel defined so far that a model served in `dtype` runs (None:
    every kernel) at once, each on a thread of its own (g++ runs outside the GIL), and return
    those threads: where a replica starts, before it loads its model. Why: on a fresh machine
    the engine asked for them one after another once the model was converted and loaded,
    ~15-25 s each, ~80 s of a first start on 2 cores before the replica could answer; started
    first they overlap the conversion and each other. A kernel the model's dtype never runs
    (the few-row fp32 linear under a bf16 model, the block-quantized one under an fp32 model:
    `NativeKernel.dtypes`) is not built: its 11-20 s of a core went to the others. A kernel
    the engine asks for meanwhile waits for its build (`load`'s lock; replicas sharing a cache
    build each once, `build_once`'s file lock); a built one only loads (a fraction of a
    second); one not prefetched builds when first asked for."""
    threads = [
        threading.Thread(target=kernel.load, name=f"kernel-{kernel.source.stem}", daemon=True)
        for kernel in KERNELS
        if dtype is None or kernel.dtypes is None or dtype in kernel.dtypes
    ]
    for thread in threads:
        thread.start()
    return threads


class NativeKernel:
    """One .cpp: `load()` builds it (once per machine) and loads its ops; False, with the
    reason logged once and kept in `why_not()`, where it cannot be used here.
    `disable_env`="0" turns it off; `after_load` registers what Python adds (fake impls).
    `needs`: what the kernel needs beyond the vector code it is built for (`extra_flags`):
    returns why this CPU falls short, or ''. `dtypes`: the model dtypes whose steps run it
    (None: any), which `prefetch` reads."""

    def __init__(
        self,
        source: Path,
        disable_env: str,
        what: str,
        after_load: Callable[[], None],
        logger: logging.Logger,
        extra_flags: tuple[str, ...] = (),
        needs: Callable[[], str] | None = None,
        dtypes: tuple[torch.dtype, ...] | None = None,
    ) -> None:
        self.source = source
        self.dtypes = dtypes
        self.extra_flags = extra_flags
        self.needs = needs
        self.disable_env = disable_env
        self.what = what
        self.after_load = after_load
        self.log = logger
        self._lock = threading.Lock()
        self._state: dict[str, str | bool] = {}  # "loaded": bool, "why": the reason it is not
        KERNELS.append(self)

    def load(self) -> bool:
        with self._lock:
            # the state this call read is the one it fills: a test that swaps in an empty
            # one to be asked afresh is not answered by a load already under way (`prefetch`)
            state = self._state
            if "loaded" not in state:
                why = self._unavailable() or self._build_and_load()
                state["loaded"], state["why"] = not why, why
                if why:
                    self.log.warning("%s not used: %s", self.what, why)
            return bool(state["loaded"])

    def require(self) -> None:
        """`load()`, raising with the reason where the kernel cannot be used here: for a
        package build that was planned with it."""
        if not self.load():
            raise RuntimeError(f"{self.what} is not available: {self.why_not()}")

    def loaded(self) -> bool:
        """Whether `load()` has loaded the op (without building or loading it)."""
        return self._state.get("loaded") is True

    def why_not(self) -> str:
        """Why `load()` returned False ('' when it did not, or was not called)."""
        return str(self._state.get("why", ""))

    def _unavailable(self) -> str:
        if os.environ.get(self.disable_env) == "0":
            return f"{self.disable_env}=0"
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ISA_FLAGS:
            return f"the CPU's vector capability is {capability}, the kernel needs AVX512 or AVX2"
        if self.needs is not None and (why := self.needs()):
            return why
        if shutil.which(compiler()) is None:
            return f"no C++ compiler ({compiler()!r}; set CXX)"
        return ""

    def _build_and_load(self) -> str:
        from torch.utils import cpp_extension

        torch_lib = Path(torch.__file__).parent / "lib"
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        command = [
            compiler(),
            *FLAGS,
            *ISA_FLAGS[torch.backends.cpu.get_cpu_capability()],
            *self.extra_flags,
            abi,
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            str(self.source),
            f"-L{torch_lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}",
        ]
        key = hashlib.sha256()
        key.update(self.source.read_bytes())
        for header in local_includes(self.source):  # a change to one rebuilds the kernel
            key.update(header.read_bytes())
        key.update(" ".join([torch.__version__, *command[1:]]).encode())
        library = cache_root() / "kernels" / f"{self.source.stem}-{key.hexdigest()[:16]}.so"

        def build() -> None:
            with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
                built = Path(tmp) / library.name
                done = subprocess.run(
                    [*command, "-o", str(built)], capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    raise RuntimeError(f"its build failed: {done.stderr.strip()[-2000:]}")
                os.replace(built, library)

        try:
            build_once(library, build, f"building {self.what} (once per machine, ~15 s)", self.log)
        except (RuntimeError, OSError) as error:
            return str(error)
        try:
            # global: an AOTInductor package calls the kernel's C shim by name
            ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
            torch.ops.load_library(str(library))
        except OSError as error:
            return f"loading {library} failed: {error}"
        self.after_load()
        return ""


def local_includes(source: Path) -> list[Path]:
    """The headers `source` includes by a quoted path (`#include "attention/cpu_vector.h"`),
    and those they include, relative to each including file, in a fixed order."""
    found: set[Path] = set()
    pending = [source]
    while pending:
        including = pending.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', including.read_text(), re.M):
            header = (including.parent / name).resolve()
            if header not in found and header.is_file():
                found.add(header)
                pending.append(header)
    return sorted(found)


def needs_avx512(feature: str, probe: str) -> Callable[[], str]:
    """A kernel's `needs` where it is built for an AVX-512 extension (`extra_flags`): '' where
    the CPU has AVX-512 and `torch.cpu.<probe>()` says it has `feature`, else why not."""

    def needs() -> str:
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AMX", "AVX512") or not getattr(torch.cpu, probe)():
            return f"it needs {feature}; this CPU's vector capability is {capability}"
        return ""

    return needs


def compiler() -> str:
    return os.environ.get("CXX", "g++")
