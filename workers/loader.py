"""Model specs to handlers: the one place that knows how each kind of model is loaded.

Spec forms (the worker's ``--model``):

- ``digits`` (or ``demo``): the demo digits CNN, built on first use; ``weights`` is
  its artifact path.
- ``torchvision:ARCH``, e.g. ``torchvision:resnet50``: weights from ``weights`` (a
  ``state_dict`` file), else the torchvision cache; ``weights="random"`` for
  benchmarks only (the version then says ``random-weights``). Nothing is downloaded.
- ``torchscript:PATH``: a ``torch.jit.save`` file.
- ``export:PATH``: a ``torch.export.save`` archive, exported with a dynamic batch dimension.
- ``package.module:ClassName``: a class of yours that satisfies ``workers.handlers.Handler``.

TorchScript and export models are served as image classifiers taking a float
(N, 3, 224, 224) batch normalized with ImageNet's mean and std; their labels come
from a JSON list in ``PATH.labels.json`` next to the file, else they are ``"0"``,
``"1"``, ....

``dtype="auto"`` and ``channels_last=None`` choose per model and device: torchvision
models on CUDA run in float16, channels-last (about twice the throughput of float32
on tensor-core GPUs, the same top-1 on all but borderline inputs; ``bench.gpu``
measures the agreement); everything else, and everything on the CPU, in float32 as
loaded. ``decode="auto"`` decodes JPEGs on the GPU when the model is on CUDA.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from PIL import Image

from schemas import Limits
from workers.demo_model import load_digits_handler
from workers.gpu_decode import DecodeOption
from workers.handlers import Handler, ImageClassifier
from workers.preprocess import DecodeBudget, ImageSpec
from workers.runner import resolve_device

log = logging.getLogger(__name__)

RANDOM_WEIGHTS = "random"
AUTO = "auto"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# torchvision's classic evaluation transform: resize the short side to 256, crop 224.
IMAGENET_IMAGE = ImageSpec(height=224, width=224, mode="RGB", crop_ratio=224 / 256)

_SPEC_FORMS = "digits, torchvision:ARCH, torchscript:PATH, export:PATH or package.module:ClassName"
_HANDLER_MEMBERS = ("name", "version", "example_item", "preprocess", "forward", "postprocess")


class ModelLoadError(ValueError):
    """A model spec, weights file or handler class that cannot be served; the message
    names the spec and what to change. Retrying does not help."""


def load_handler(
    spec: str,
    *,
    device: str,
    weights: str | None,
    dtype: str,
    channels_last: bool | None,
    limits: Limits,
    decode: DecodeOption = "auto",
    allow_pickle: bool = False,
    decode_budget: DecodeBudget | None = None,
) -> Handler:
    """Build the handler a model spec names, its model on ``device`` (``auto`` allowed).

    ``allow_pickle`` must be set to load a ``torch.export`` archive: ``torch.export.load``
    unpickles parts of the file, which can run code from it.

    ``dtype`` is a name in ``DTYPES`` or ``auto``; ``channels_last=None`` is automatic
    (see the module doc); ``decode`` is passed to image classifiers (the demo model's
    PNGs are always decoded on the CPU); ``decode_budget`` bounds the memory of their
    CPU decodes running at once, and is offered to user classes that take it.

    Raises ``ModelLoadError`` for a malformed spec, a missing or unfitting weights
    file, or a class that is not a handler; ``ValueError`` for a device that does not exist.
    """
    if dtype != AUTO and dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {AUTO}, {', '.join(DTYPES)}")
    dev = resolve_device(device)
    kind, _, rest = spec.partition(":")
    # Reduced precision and channels-last pay off for convolution-heavy models on
    # tensor cores; other models may not tolerate them, so auto leaves them in float32.
    fast = kind == "torchvision" and dev.type == "cuda"
    torch_dtype = DTYPES[dtype] if dtype != AUTO else (torch.float16 if fast else torch.float32)
    channels_last = fast if channels_last is None else channels_last
    if spec in ("digits", "demo"):
        if weights == RANDOM_WEIGHTS:
            raise ModelLoadError(
                f"{spec}: the demo model trains its own weights in seconds; leave weights unset "
                "or pass the path of its artifact"
            )
        path = Path(weights) if weights else None
        return load_digits_handler(
            path,
            device=dev,
            dtype=torch_dtype,
            channels_last=channels_last,
            limits=limits,
            decode_budget=decode_budget,
        )
    if kind == "torchvision" and rest:
        handler = _torchvision(rest, weights, dev, torch_dtype, channels_last, limits, decode)
        handler.decode_budget = decode_budget
        return handler
    if kind in ("torchscript", "export") and rest:
        _no_weights(spec, weights)
        if kind == "export":
            _check_pickle_allowed(spec, allow_pickle)
        load = _torchscript if kind == "torchscript" else _exported
        handler = load(Path(rest), spec, dev, torch_dtype, channels_last, limits, decode)
        handler.decode_budget = decode_budget
        return handler
    if _is_import_path(kind) and rest.isidentifier():
        options = {
            "device": dev,
            "weights": weights,
            "dtype": torch_dtype,
            "channels_last": channels_last,
            "limits": limits,
            "decode": decode,
            "decode_budget": decode_budget,
        }
        return _user_class(spec, options)
    raise ModelLoadError(f"model spec {spec!r} is not one of: {_SPEC_FORMS}")


def _check_pickle_allowed(spec: str, allow_pickle: bool) -> None:
    if not allow_pickle:
        raise ModelLoadError(
            f"{spec}: torch.export archives are unpickled when loaded, which can run code "
            "stored in the file; serve only archives you trust, and say so with "
            "--allow-pickle-models (CONVEYOR_ALLOW_PICKLE_MODELS=true)"
        )
    log.warning("%s: loading a pickle-based archive (allowed by --allow-pickle-models)", spec)


def _is_import_path(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _no_weights(spec: str, weights: str | None) -> None:
    if weights is not None:
        raise ModelLoadError(
            f"{spec}: weights={weights!r} does not apply, the file holds its weights; "
            "leave weights unset"
        )


def _torchvision(
    arch: str,
    weights: str | None,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
) -> ImageClassifier:
    import torchvision  # only the torchvision spec pays for this import

    spec = f"torchvision:{arch}"
    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        raise ModelLoadError(
            f"{spec}: no torchvision classification model is called {arch!r}; "
            f"known ones include {', '.join(sorted(known)[:12])}, ..."
        )
    # Architectures with published weights carry their labels and input transform
    # as metadata inside torchvision; reading it downloads nothing.
    published = torchvision.models.get_model_weights(arch).DEFAULT
    transform = published.transforms()
    crop, resize = transform.crop_size[0], transform.resize_size[0]
    image = ImageSpec(
        height=crop,
        width=crop,
        mode="RGB",
        crop_ratio=crop / resize,
        resample=Image.Resampling[transform.interpolation.name],
    )
    labels: list[str] = list(published.meta["categories"])
    file: Path | None = None
    if weights is None:
        file = _torchvision_cached(spec, published.url)
        version = f"{arch}:{published.name}"
    elif weights == RANDOM_WEIGHTS:
        version = f"{arch}:random-weights"
    else:
        file = Path(weights)
        _require_file(spec, file)
        # A fine-tuned model names its own classes; the architecture is sized to them.
        labels = _sidecar_labels(file) or labels
        version = f"{arch}:sha256-{_sha256(file)[:12]}"
    module = torchvision.models.get_model(arch, weights=None, num_classes=len(labels))
    if file is not None:
        _load_state_dict(spec, module, file)
    return ImageClassifier(
        module,
        name=arch,
        version=version,
        labels=labels,
        image=image,
        mean=transform.mean,
        std=transform.std,
        device=device,
        dtype=dtype,
        channels_last=channels_last,
        limits=limits,
        decode=decode,
    )


def _torchvision_cached(spec: str, url: str) -> Path:
    # Where torchvision's own download would have put the file.
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name
    if not file.is_file():
        raise ModelLoadError(
            f"{spec}: no weights given and {file} is not in the torchvision cache; "
            "nothing can be downloaded here. Copy that file there, pass weights=PATH "
            "(a state_dict saved with torch.save), or weights='random' for a benchmark "
            "whose outputs mean nothing"
        )
    return file


def _load_state_dict(spec: str, module: torch.nn.Module, file: Path) -> None:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]  # a training checkpoint around the weights
        module.load_state_dict(state)
    except Exception as exc:
        raise ModelLoadError(
            f"{spec}: cannot load weights from {file}: {exc}. It must be the model's "
            "state_dict saved with torch.save (plain tensors, loadable with weights_only=True)"
        ) from exc


def _torchscript(
    path: Path,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
) -> ImageClassifier:
    _require_file(spec, path)
    try:
        # torch.jit.load has no annotations in torch's sources.
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ModelLoadError(f"{spec}: not a TorchScript file (torch.jit.save): {exc}") from exc
    return _file_classifier(
        path, module, device, dtype, channels_last, limits, decode, set_eval=True
    )


def _exported(
    path: Path,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
) -> ImageClassifier:
    from torch.export.passes import move_to_device_pass

    _require_file(spec, path)
    try:
        program = torch.export.load(path)
    except Exception as exc:
        raise ModelLoadError(
            f"{spec}: not a torch.export archive (torch.export.save): {exc}"
        ) from exc
    # Exported graphs can bake the export device into their operations; this pass
    # rewrites those too, where a plain .to() would only move the weights.
    module = move_to_device_pass(program, device).module()
    return _file_classifier(
        path, module, device, dtype, channels_last, limits, decode, set_eval=False
    )


def _file_classifier(
    path: Path,
    module: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
    *,
    set_eval: bool,
) -> ImageClassifier:
    classes = _count_classes(path, module, device, dtype)
    labels = _sidecar_labels(path) or [str(i) for i in range(classes)]
    if len(labels) != classes:
        raise ModelLoadError(
            f"{path}.labels.json lists {len(labels)} labels, but the model scores {classes} classes"
        )
    return ImageClassifier(
        module,
        name=path.stem,
        version=f"{path.name}:sha256-{_sha256(path)[:12]}",
        labels=labels,
        image=IMAGENET_IMAGE,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        device=device,
        dtype=dtype,
        channels_last=channels_last,
        limits=limits,
        set_eval=set_eval,
        decode=decode,
    )


def _count_classes(
    path: Path, module: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> int:
    """The number of classes, found by running blank batches of one and of two: this
    also refuses, at start-up, a model that cannot take every batch size."""
    classes = 0
    for size in (1, 2):
        probe = torch.zeros((size, 3, IMAGENET_IMAGE.height, IMAGENET_IMAGE.width), device=device)
        try:
            with torch.inference_mode():
                out = module.to(device=device, dtype=dtype)(probe.to(dtype))
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: the model failed on a blank ({size}, 3, 224, 224) batch: {exc}. It "
                "must take a normalized float NCHW batch of any size (for torch.export, "
                "export with a dynamic batch dimension)"
            ) from exc
        if not isinstance(out, torch.Tensor) or out.shape[:1] != (size,) or out.ndim != 2:
            raise ModelLoadError(
                f"{path}: the model must map a (N, 3, 224, 224) batch to (N, classes) scores"
            )
        classes = out.shape[1]
    return classes


def _sidecar_labels(path: Path) -> list[str] | None:
    """Labels from ``PATH.labels.json`` (a JSON list of strings), if that file exists."""
    sidecar = path.with_name(f"{path.name}.labels.json")
    if not sidecar.is_file():
        return None
    try:
        labels = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{sidecar}: cannot read labels: {exc}") from exc
    if not (isinstance(labels, list) and labels and all(isinstance(s, str) for s in labels)):
        raise ModelLoadError(f"{sidecar}: must hold a non-empty JSON list of label strings")
    return labels


def _user_class(spec: str, options: dict[str, Any]) -> Handler:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"{spec}: cannot import module {module_name!r} ({exc}); is it installed or on "
            f"PYTHONPATH? Other spec forms: {_SPEC_FORMS}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise ModelLoadError(f"{spec}: module {module_name!r} has no class {class_name!r}")
    try:
        handler = cls(**_accepted_options(cls, options))
    except Exception as exc:
        raise ModelLoadError(f"{spec}: creating {class_name} failed: {exc!r}") from exc
    if not isinstance(handler, Handler):
        missing = [member for member in _HANDLER_MEMBERS if not hasattr(handler, member)]
        raise ModelLoadError(
            f"{spec}: {class_name} is not a handler, it lacks {', '.join(missing)}; "
            "see workers.handlers.Handler"
        )
    return handler


def _accepted_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options a class's ``__init__`` names (all of them if it takes ``**kwargs``)."""
    parameters = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return options
    names = {p.name for p in parameters}
    return {key: value for key, value in options.items() if key in names}


def _require_file(spec: str, path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{spec}: {path} does not exist or is not a file")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
