"""Where compiled code is kept, so that a host compiles a model once.

Inductor writes what it generates (compiled graphs, Triton's kernels, autotuning
results) to a cache folder and reads it back on the next compilation of the same
graph: a process that finds the work done loads it instead of compiling.
``use_compile_cache`` points that folder at ``<compile_cache>/<key>`` before the
first compilation; with ``--compile-form package`` (the default) the compiled
forward of each batch-size bucket is also kept there, in ``packages/``, and a later
start loads it without tracing the model (``workers.model.packages``). The supervisor of a host's
processes (``workers.fleet``) starts one process first and the others once it is
ready, so they load what it compiled; a restarted process loads it too.

The cache is never stale. Inductor keys every entry by the graph itself, the shapes
and types of its inputs, its own configuration, torch's version and the device, so
an entry is used only for exactly the code it was made from. On top of that the
folder ``<key>`` is the SHA-256 of what the worker knows changes the compiled code
or makes an old entry useless: the model spec, the weights file (path, size and
modification time), dtype, quantized layers (when asked for), channels-last, the
largest batch size, the compiled form (``--compile-form``), CUDA graphs on or off,
the versions of torch, CUDA, Triton and Python, and the GPU's name and compute
capability. An upgrade or another card starts a new folder instead of searching an
old one; old folders can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from workers.config.worker import COMPILE_CACHE_WARM_MARK, WorkerSettings

log = logging.getLogger(__name__)

INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def cache_root(settings: WorkerSettings) -> Path:
    """``compile_cache``, else ``$XDG_CACHE_HOME/conveyor-serve/compile``, else
    ``~/.cache/conveyor-serve/compile``; absolute (Inductor runs its C++ compiler in a
    folder of its own, where a relative path names nothing)."""
    if settings.compile_cache is not None:
        return settings.compile_cache.expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "conveyor-serve" / "compile").absolute()


def cache_key(settings: WorkerSettings, device: torch.device) -> str:
    """The folder name: a hash of everything that makes compiled code differ (see above)."""
    facts: dict[str, object] = {
        "model": settings.model,
        "weights": _file_identity(settings.weights),
        "model_options": settings.model_options,
        "dtype": settings.dtype,
        "channels_last": settings.channels_last,
        "max_batch_size": settings.max_batch_size,
        "compile_form": settings.compile_form,
        "cuda_graphs": settings.cuda_graphs,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "device": _device_identity(device),
    }
    if settings.quantize != "none":  # only then: the default's folders keep their names
        facts["quantize"] = settings.quantize
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def use_compile_cache(settings: WorkerSettings, device: torch.device) -> Path:
    """Point torch.compile's cache at this model's folder (made if need be); returns it.

    Must run before the first compilation in the process. A folder that cannot be
    made leaves torch's default in place, with a warning: compiling still works.
    """
    folder = cache_root(settings) / cache_key(settings, device)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning(
            "compile cache folder %s cannot be made (%s); compiling without it: "
            "every start compiles again (set --compile-cache to a writable folder)",
            folder,
            exc.strerror or exc,
        )
        return folder
    os.environ[INDUCTOR_CACHE_VARIABLE] = str(folder)
    log.info("compile cache: %s", folder)
    return folder


def mark_warm(folder: Path) -> None:
    """Say that ``folder`` holds a whole compilation of the model (best effort)."""
    try:
        (folder / COMPILE_CACHE_WARM_MARK).touch()
    except OSError:
        return  # a read-only cache still serves; only the next host's start is slower


def _file_identity(path: str | None) -> object:
    if path is None or not Path(path).is_file():
        return path  # None, "random", or a name the loader resolves (and reports)
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def _device_identity(device: torch.device) -> object:
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return [props.name, props.major, props.minor]


def _triton_version() -> str | None:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
