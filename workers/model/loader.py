"""Model specs to handlers: the one place that knows how each kind of model is loaded.

Spec forms (the worker's ``--model``):

- ``digits`` (or ``demo``): short for ``demo.models.digits:DigitsClassifier``, the
  demo digits CNN, built on first use; ``weights`` is its artifact path. It loads as
  a class of yours does (below): ``workers`` does not import the demo.
- ``torchvision:ARCH``, e.g. ``torchvision:resnet50``, ``torchvision:fasterrcnn_resnet50_fpn``,
  ``torchvision:deeplabv3_resnet50``: a classification, detection (boxes, masks or
  keypoints) or semantic segmentation model (``workers.handlers.torchvision_models``), weights
  from ``weights``: a ``state_dict`` file, or published weights by name (``DEFAULT``,
  ``IMAGENET1K_V2``), downloaded into torch hub's cache unless they are there already;
  without ``weights``, the default published weights from that cache (never a download);
  ``weights="random"`` for benchmarks only (the version then says ``random-weights``).
  ``options`` go to torchvision's model builder.
- ``embedding:ARCH``, e.g. ``embedding:resnet50``: that classification model without
  its head, answering with one vector per image; weights as for ``torchvision:ARCH``.
- ``timm:NAME``, e.g. ``timm:convnext_atto.d2_in1k``: a timm image classifier with
  timm's own data config (``workers.handlers.timm_models``, the ``timm`` extra); weights
  as for ``torchvision:ARCH``, ``DEFAULT`` being the tag's weights on the Hugging Face Hub.
- ``hf:PATH_OR_ID``, e.g. ``hf:./my-classifier`` or ``hf:owner/name``: a transformers
  text model with its fast tokenizer (``workers.handlers.hf_models``, the ``hf`` extra):
  text classification, token classification or sentence embeddings; or an object
  detector of a fixed input size (RT-DETR, ``workers.handlers.hf_detection``; float16
  autocast on CUDA by default); or an image classifier or a CLIP/SigLIP dual encoder
  (``workers.handlers.hf_images``); a local folder always, a hub id from the Hugging
  Face cache, downloaded only with ``weights="DEFAULT"``.
- ``torchscript:PATH``: a ``torch.jit.save`` file.
- ``export:PATH``: a ``torch.export.save`` archive, exported with a dynamic batch dimension.
- ``tabular:PATH``: a model over feature records (``workers.handlers.tabular``): a
  TorchScript file, a ``torch.export`` archive (``.pt2``) or a pickled scikit-learn-style
  estimator (``.joblib``), its feature schema in ``PATH.features.toml`` beside it (or
  named by the ``schema`` model option); ``backend`` (option) runs an estimator by its
  own predict (``native``) or as Hummingbird's tensor program (``hummingbird``).
- ``package.module:ClassName``: a class of yours that satisfies ``workers.handlers.base.Handler``.

TorchScript and export models are served as image classifiers taking a float
(N, 3, 224, 224) batch normalized with ImageNet's mean and std; their labels come
from a JSON list in ``PATH.labels.json`` next to the file, else they are ``"0"``,
``"1"``, ....

``dtype="auto"`` and ``channels_last=None`` choose per model and device: on CUDA,
the dtype of the model's family in ``workers.model.precision``'s table (float16 for
torchvision models and for timm's ViTs, ConvNeXts, EfficientNets and ResNets: about
twice the throughput of float32 on tensor-core GPUs, the same top-1 on all but
borderline inputs; ``bench.precision`` measures the agreement), torchvision's
classifiers and embedding models channels-last too, detectors and segmenters under
autocast; everything else, and everything on the CPU, in float32 as loaded.
``decode="auto"`` decodes JPEGs on the GPU when the model is on CUDA.
``preprocess="auto"`` fits images as the reference transform does for
``torchvision:``, ``embedding:`` and ``timm:`` classifiers (torchvision's, timm's), and
the ``fast`` way for TorchScript and export files (``workers.decode.images``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from schemas import Limits
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.decode.images import ImageSpec
from workers.handlers.base import Handler, ImageClassifier
from workers.handlers.hf_models import TextServing, load_hf
from workers.handlers.timm_models import load_timm
from workers.handlers.torchvision_models import Preprocess, Serving, load_torchvision
from workers.handlers.weights import (
    ModelLoadError,
    require_file,
    sha256,
    sidecar_labels,
)
from workers.model.precision import auto_family
from workers.model.runner import resolve_device

log = logging.getLogger(__name__)

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

_SPEC_FORMS = (
    "digits, torchvision:ARCH, embedding:ARCH, timm:NAME, hf:PATH_OR_ID, torchscript:PATH, "
    "export:PATH, tabular:PATH or "
    "package.module:ClassName"
)
SHORT_SPECS = {
    "digits": "demo.models.digits:DigitsClassifier",
    "demo": "demo.models.digits:DigitsClassifier",
}
"""Spec names that stand for a handler class of the ``demo`` package."""
_HANDLER_MEMBERS = ("name", "version", "example_item", "preprocess", "forward", "postprocess")

__all__ = ["DTYPES", "IMAGENET_IMAGE", "ModelLoadError", "load_handler"]


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
    preprocess: Preprocess = "auto",
    options: Mapping[str, Any] | None = None,
    text: TextServing | None = None,
) -> Handler:
    """Build the handler a model spec names, its model on ``device`` (``auto`` allowed).

    ``allow_pickle`` must be set to load a ``torch.export`` archive: ``torch.export.load``
    unpickles parts of the file, which can run code from it.

    ``dtype`` is a name in ``DTYPES`` or ``auto``; ``channels_last=None`` is automatic
    (see the module doc); ``decode`` is passed to image models (the demo model's
    PNGs are always decoded on the CPU); ``decode_budget`` bounds the memory of their
    CPU decodes running at once, and is offered to user classes that take it;
    ``preprocess`` is ``auto``, ``reference`` or ``fast`` for models of a fixed input
    size; ``options`` are model options for ``torchvision:``, ``embedding:`` and ``timm:``
    specs (``workers.handlers.torchvision_models``, ``workers.handlers.timm_models``) and
    are passed to a class of yours as ``model_options`` if it takes them; ``text`` holds
    the task and length rules of ``hf:`` specs (``workers.handlers.hf_models``).

    Raises ``ModelLoadError`` for a malformed spec, a missing or unfitting weights
    file, options the model does not take, or a class that is not a handler;
    ``ValueError`` for a device that does not exist.
    """
    if dtype != AUTO and dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {AUTO}, {', '.join(DTYPES)}")
    if preprocess not in (AUTO, "reference", "fast"):
        raise ModelLoadError(f"preprocess {preprocess!r} is not one of auto, reference, fast")
    options = dict(options or {})
    dev = resolve_device(device)
    spec = SHORT_SPECS.get(spec, spec)
    kind, _, rest = spec.partition(":")
    torch_dtype = _chosen_dtype(spec, dtype, dev)
    serving = Serving(
        dev, torch_dtype, channels_last, limits, decode, decode_budget, preprocess, options
    )
    if kind in ("torchvision", "embedding") and rest:
        return load_torchvision(
            rest, embedding=kind == "embedding", weights=weights, serving=serving
        )
    if kind == "timm" and rest:
        return load_timm(rest, weights=weights, serving=serving)
    if kind == "hf" and rest:
        return load_hf(
            rest,
            weights=weights,
            serving=serving,
            text=text or TextServing(),
            auto_dtype=dtype == AUTO,
        )
    if kind == "tabular" and rest:
        from workers.handlers.tabular import load_tabular

        return load_tabular(
            spec,
            Path(rest),
            weights=weights,
            device=dev,
            allow_pickle=allow_pickle,
            options=options,
        )
    if _is_import_path(kind) and rest.isidentifier():
        given = {
            "device": dev,
            "weights": weights,
            "dtype": torch_dtype,
            "channels_last": bool(channels_last),
            "limits": limits,
            "decode": decode,
            "decode_budget": decode_budget,
            "model_options": options,
        }
        return _user_class(spec, given)
    if options:
        raise ModelLoadError(
            f"{spec}: model options {options} apply to torchvision:, embedding:, timm: and "
            "your own handler classes only; leave them unset"
        )
    channels_last = bool(channels_last)
    if kind in ("torchscript", "export") and rest:
        _no_weights(spec, weights)
        if kind == "export":
            _check_pickle_allowed(spec, allow_pickle)
        load = _torchscript if kind == "torchscript" else _exported
        image = replace(IMAGENET_IMAGE, fit="reference" if preprocess == "reference" else "fast")
        handler = load(Path(rest), spec, dev, torch_dtype, channels_last, limits, decode, image)
        handler.decode_budget = decode_budget
        return handler
    raise ModelLoadError(f"model spec {spec!r} is not one of: {_SPEC_FORMS}")


def auto_dtype(spec: str, device: torch.device) -> torch.dtype:
    """What ``dtype="auto"`` runs ``spec`` in on ``device``: its family's dtype in the
    table of ``workers.model.precision`` (half precision on CUDA for the families whose
    agreement with float32 holds, float32 elsewhere and on the CPU)."""
    return auto_family(SHORT_SPECS.get(spec, spec), device).dtype


def _chosen_dtype(spec: str, dtype: str, device: torch.device) -> torch.dtype:
    """``dtype`` by name, or for ``auto`` its family's, said in the log with the family."""
    if dtype != AUTO:
        return DTYPES[dtype]
    family = auto_family(spec, device)
    name = str(family.dtype).removeprefix("torch.")
    log.info("%s runs in %s (--dtype auto: %s)", spec, name, family.label)
    return family.dtype


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


def _torchscript(
    path: Path,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
    image: ImageSpec,
) -> ImageClassifier:
    require_file(spec, path)
    try:
        # torch.jit.load has no annotations in torch's sources.
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as exc:
        if device_fault(exc):
            raise  # the card's, not the file's
        raise ModelLoadError(f"{spec}: not a TorchScript file (torch.jit.save): {exc}") from exc
    return _file_classifier(
        path, module, device, dtype, channels_last, limits, decode, image, set_eval=True
    )


def _exported(
    path: Path,
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
    image: ImageSpec,
) -> ImageClassifier:
    from torch.export.passes import move_to_device_pass

    require_file(spec, path)
    try:
        program = torch.export.load(path)
    except Exception as exc:
        if device_fault(exc):
            raise  # the card's, not the file's
        raise ModelLoadError(
            f"{spec}: not a torch.export archive (torch.export.save): {exc}"
        ) from exc
    # Exported graphs can bake the export device into their operations; this pass
    # rewrites those too, where a plain .to() would only move the weights.
    module = move_to_device_pass(program, device).module()
    return _file_classifier(
        path, module, device, dtype, channels_last, limits, decode, image, set_eval=False
    )


def _file_classifier(
    path: Path,
    module: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    limits: Limits,
    decode: DecodeOption,
    image: ImageSpec,
    *,
    set_eval: bool,
) -> ImageClassifier:
    classes = _count_classes(path, module, device, dtype)
    labels = sidecar_labels(path) or [str(i) for i in range(classes)]
    if len(labels) != classes:
        raise ModelLoadError(
            f"{path}.labels.json lists {len(labels)} labels, but the model scores {classes} classes"
        )
    return ImageClassifier(
        module,
        name=path.stem,
        version=f"{path.name}:sha256-{sha256(path)[:12]}",
        labels=labels,
        image=image,
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
            if device_fault(exc):
                raise  # the card's, not the model's
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


_DEVICE_ERROR = re.compile(
    r"\bCUDA (driver )?error\b|\bcuDNN error\b|CUBLAS_STATUS_|CUDNN_STATUS_|\bNCCL error\b"
)
"""A device's error as torch or Inductor words it in a RuntimeError (torch raises
``torch.AcceleratorError`` for most, Inductor's launchers a plain RuntimeError)."""


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a model loads or warms up, is its device's doing
    rather than the model's: memory it could not have (``torch.OutOfMemoryError``,
    ``MemoryError``) or an accelerator's error. Such a load may succeed on another card,
    or when more memory is free; a model error is the same wherever it loads."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError, torch.AcceleratorError)):
        return True
    return isinstance(exc, RuntimeError) and _DEVICE_ERROR.search(str(exc)) is not None


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
    accepted = _accepted_options(spec, cls, options)
    try:
        handler = cls(**accepted)
    except OSError:
        raise  # the system refused a file or folder: the environment's fault, not the class's
    except Exception as exc:
        if device_fault(exc):
            raise  # the card's, not the class's: the worker says so (workers.app)
        raise ModelLoadError(f"{spec}: creating {class_name} failed: {exc!r}") from exc
    if not isinstance(handler, Handler):
        missing = [member for member in _HANDLER_MEMBERS if not hasattr(handler, member)]
        raise ModelLoadError(
            f"{spec}: {class_name} is not a handler, it lacks {', '.join(missing)}; "
            "see workers.handlers.Handler"
        )
    return handler


def _accepted_options(spec: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options a class's ``__init__`` names (all of them if it takes ``**kwargs``).

    Model options given to a class that takes no ``model_options`` are refused: they
    would be dropped without a word.
    """
    parameters = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return options
    names = {p.name for p in parameters}
    if options.get("model_options") and "model_options" not in names:
        raise ModelLoadError(
            f"{spec}: model options {options['model_options']} apply to torchvision:, "
            f"embedding:, timm: and handler classes that take model_options; "
            f"{cls.__name__} does not"
        )
    return {key: value for key, value in options.items() if key in names}
