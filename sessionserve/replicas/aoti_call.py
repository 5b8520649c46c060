"""Running an AOTInductor package without holding the GIL.

torch's loaders (`aoti_load_package`, its `boxed_run`) hold the GIL for the whole call. The
compiled forward calls back into Python at every layer (its attention op), so other threads
got the GIL there; a package with no Python inside (the decode step compiled whole,
compiled_decode.py) held it for the whole step, 15-40 ms on a CPU, and the replica's other
threads (the event loop that streams tokens, the ingress when it is colocated) waited: served
with 8 concurrent streams, output tokens/s fell to 0.75x though each step ran 1.2x faster.

So such a package is run through the C entry points AOTInductor compiles into its shared
library (`AOTInductorModelContainerCreateWithDevice`, `...Run`: aoti_runtime/interface.h)
with ctypes, which releases the GIL for the duration of a foreign call. Tensors cross as
AtenTensorHandles made by torch's own helpers (`torch._C._aoti`). Only for packages without
custom ops (their calls need the proxy executor torch's loader provides) and on CPU.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import tempfile
import threading
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from sessionserve.replicas.compiled_forward import EXTRACTION_PREFIX, load_flat

log = logging.getLogger(__name__)

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class ReleasedCall:
    """A CPU package's model as a function of its positional tensors (its flat outputs
    returned), called with the GIL released. One call at a time (the container has one
    model; a second caller waits on a lock, which it does without the GIL)."""

    def __init__(self, package: Path) -> None:
        library = _extract_library(package)
        try:
            self._lib = ctypes.CDLL(str(library))
        finally:
            shutil.rmtree(library.parent, ignore_errors=True)
        handle = ctypes.c_void_p()
        self._check(
            self._lib.AOTInductorModelContainerCreateWithDevice(
                ctypes.byref(handle), ctypes.c_size_t(1), b"cpu", None
            ),
            "create the model container",
        )
        self._handle = handle
        count = ctypes.c_size_t()
        self._check(
            self._lib.AOTInductorModelContainerGetNumOutputs(handle, ctypes.byref(count)),
            "read the output count",
        )
        self._outputs = count.value
        self._check(
            self._lib.AOTInductorModelContainerGetNumInputs(handle, ctypes.byref(count)),
            "read the input count",
        )
        self._inputs = count.value
        self._lock = threading.Lock()  # the handles below are per call
        weakref.finalize(self, self._lib.AOTInductorModelContainerDelete, handle)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        if len(inputs) != self._inputs:  # the library would read past them and abort
            raise TypeError(f"the package takes {self._inputs} tensors, not {len(inputs)}")
        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(inputs))
        handles = (ctypes.c_void_p * len(capsules))(*(_get_pointer(c, None) for c in capsules))
        outputs = (ctypes.c_void_p * self._outputs)()
        with self._lock:
            error = self._lib.AOTInductorModelContainerRun(  # the inputs' handles are stolen
                self._handle,
                handles,
                ctypes.c_size_t(len(capsules)),
                outputs,
                ctypes.c_size_t(self._outputs),
                None,
                None,
            )
        self._check(error, "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_new_capsule(p, None, None) for p in outputs]
        )

    @staticmethod
    def _check(error: int, what: str) -> None:
        if error != 0:
            raise RuntimeError(f"AOTInductor could not {what} (error {error}); see its log")


def _extract_library(package: Path) -> Path:
    """The package's shared library, unpacked into a fresh temp directory that is removed
    again once the library is loaded (a mapped file outlives its name on Linux); what a
    killed process leaves is `remove_stale_extractions`' (same prefix)."""
    with zipfile.ZipFile(package) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
        where = Path(tempfile.mkdtemp(prefix=EXTRACTION_PREFIX))
        library = where / Path(name).name
        with archive.open(name) as src, library.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    return library


def load_releasing_gil(package: Path) -> Callable[..., list[torch.Tensor]]:
    """`ReleasedCall(package)`, or, where that cannot load (another torch's layout, another
    OS), `load_flat` (the GIL then held while it runs), said in the log."""
    try:
        return ReleasedCall(package)
    except Exception as e:  # noqa: BLE001 - torch's loader still runs the package
        log.warning("compile: %s runs holding the GIL (%r)", package.name, e)
        return load_flat(package)
