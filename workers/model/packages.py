"""A compiled forward kept as packages, one per batch-size bucket, loaded without tracing.

``torch.compile`` keeps its generated code in a cache, but a new process still
traces the model with Dynamo, builds the guards and looks every graph up before
the cache hands the code back: seconds per bucket at every start, however warm the
cache. Here the first start exports each bucket's forward (``torch.export``) and
compiles the graph with Inductor (``torch._inductor.standalone_compile``, the
compiler behind ``torch.compile``, so the same kernels); the result is saved as one
file a bucket, which a later start loads and calls without tracing anything.

The exported graph takes the weights as inputs, so a package holds code, not
weights: each call passes the tensors of the model just loaded (in the order kept
beside the package), and a package never serves other weights. Each package is
named by a fingerprint of what its code depends on beyond the compile cache
folder's key (``workers.model.compile_cache``): the input's shape, dtype, strides
and device (its index too: the code names it), the model's layers with their
settings (its ``repr``), every parameter's and buffer's name, shape, dtype and
strides, and the source of every module class in the model. A changed model gets
new packages, never an old one. Packages are written under a temporary name and
renamed, so a process never loads a half-written one.

A handler qualifies when it is ``Exportable`` (fixed-size image models are); a model
``torch.export`` cannot take, or whose package does not build, is compiled by
``torch.compile`` instead, with a warning saying why.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PACKAGES_FOLDER = "packages"
"""The subfolder of a compile cache folder that holds the packages."""

Forward = Callable[[torch.Tensor], Any]


def packaged_forward(
    module: torch.nn.Module,
    sizes: Sequence[int],
    example: Callable[[int], torch.Tensor],
    folder: Path,
) -> Forward | None:
    """A forward that runs ``module`` through one package per batch size in ``sizes``,
    building the packages missing from ``folder`` (``example(size)``: a batch of that
    size, as the forward will be given them; made one at a time).

    Batches of another size run ``module`` eagerly. Returns ``None``, with a warning,
    when a package cannot be built or loaded: the caller compiles some other way.
    """
    constants = _tensors(module)
    model = fingerprint_model(module)
    loaded: dict[int, Any] = {}
    started = time.monotonic()
    built = 0
    try:
        for size in sorted(set(sizes)):
            batch = example(size)
            path = folder / f"forward-{_fingerprint(model, batch)}.bin"
            if not path.is_file():
                build_package(module, batch, path)
                built += 1
            del batch
            loaded[size] = load_package(path, constants)
    except Exception as exc:  # any failure of export or Inductor: compile another way
        log.warning(
            "the model could not be compiled into packages (%s: %s); compiling it with "
            "torch.compile instead (--compile-form static skips this attempt)",
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        )
        return None
    log.info(
        "compiled forward: %d package(s) for batch sizes %s (%d built) in %.1f s, in %s",
        len(loaded),
        sorted(loaded),
        built,
        time.monotonic() - started,
        folder,
    )

    def forward(batch: torch.Tensor) -> Any:
        package = loaded.get(batch.shape[0]) if isinstance(batch, torch.Tensor) else None
        return module(batch) if package is None else package(batch)

    return forward


def build_package(module: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    """Export ``module`` for ``example``'s shape and compile it into a package at ``path``."""
    # Imported here: a start that finds its packages never needs the compiler's entry.
    from torch._inductor import standalone_compile

    started = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        exported = torch.export.export(module, (example,), strict=False)
    # The exported graph takes the weights as inputs, ahead of the batch: compiled so,
    # it leaves them out, and each caller passes its own, in this order.
    names = [spec.target for spec in exported.graph_signature.input_specs if spec.target]
    tensors = _tensors(module)
    inputs: list[Any] = [tensors[name] for name in names] + [example]
    with torch.inference_mode():
        compiled = standalone_compile(
            exported.graph_module, inputs, dynamic_shapes="from_example_inputs"
        )
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
    partial_names = _names_path(partial)
    try:
        compiled.save(path=str(partial), format="binary")
        partial_names.write_text(json.dumps(names))
        partial_names.replace(_names_path(path))
        partial.replace(path)  # last: a package that exists is whole, and so are its names
    finally:
        partial.unlink(missing_ok=True)
        partial_names.unlink(missing_ok=True)
    log.info(
        "built package %s for a batch of %s in %.1f s",
        path.name,
        tuple(example.shape),
        time.monotonic() - started,
    )


def load_package(path: Path, constants: Mapping[str, torch.Tensor]) -> Forward:
    """The package at ``path``, called with ``constants`` (by name) as its weights.

    Raises ``KeyError`` naming a weight the package needs that ``constants`` lacks.
    """
    from torch._inductor.standalone_compile import CompiledArtifact

    names = json.loads(_names_path(path).read_text())
    missing = [name for name in names if name not in constants]
    if missing:
        raise KeyError(f"the package needs weights the model does not have: {missing[:3]}")
    weights = [constants[name] for name in names]
    compiled = CompiledArtifact.load(path=str(path), format="binary")

    def forward(batch: torch.Tensor) -> Any:
        return compiled(*weights, batch)[0]

    return forward


def fingerprint_model(module: torch.nn.Module) -> str:
    """A hash of the module's tree (``repr``: every layer with its settings), its
    tensors' names and layouts, and its classes' source."""
    digest = hashlib.sha256(repr(module).encode())
    for name, tensor in sorted(_tensors(module).items()):
        digest.update(f"{name}:{_layout(tensor)};".encode())
    for source in sorted({_class_source(type(m)) for m in module.modules()}):
        digest.update(source.encode())
    for m in module.modules():
        code = getattr(m, "code", None)  # an exported module's forward is generated code
        if isinstance(code, str):
            digest.update(code.encode())
    return digest.hexdigest()


def is_subclass_tensor(tensor: torch.Tensor) -> bool:
    """A tensor subclass (torchao's quantized weights are), not a plain tensor."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def _names_path(package: Path) -> Path:
    return package.with_suffix(".json")


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by name: what a package takes as weights."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return tensors


def _fingerprint(model: str, example: torch.Tensor) -> str:
    return package_fingerprint(model, _layout(example), example.device)


def package_fingerprint(model: str, layout: str, device: torch.device) -> str:
    """The name of a package for ``model`` (``fingerprint_model``) on inputs of ``layout``
    on ``device``, its index included: the package's code names the device it was
    compiled on, so ``cuda:1`` never loads one built on ``cuda:0``."""
    text = f"{model}|{layout}|{device}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _layout(tensor: torch.Tensor) -> str:
    text = f"{tuple(tensor.shape)}:{tensor.dtype}:{tensor.stride()}"
    if is_subclass_tensor(tensor):  # a quantized weight computes otherwise than a plain one
        text += f":{type(tensor).__module__}.{type(tensor).__qualname__}"
    return text


def _class_source(cls: type) -> str:
    """The text of the file that defines ``cls``, else its qualified name."""
    try:
        return Path(inspect.getfile(cls)).read_text(encoding="utf-8", errors="replace")
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"
