"""``torchvision:ARCH`` and ``embedding:ARCH``: torchvision architectures as handlers.

The task follows from where torchvision lists the architecture (docs/models.md has
the full list):

- classification (``resnet50``, ``efficientnet_b0``, ``vit_b_16``, ...): ``ImageClassifier``;
- detection (``fasterrcnn_*``, ``retinanet_*``, ``fcos_*``, ``ssd300_vgg16``,
  ``ssdlite320_*``), instance segmentation (``maskrcnn_*``) and keypoints
  (``keypointrcnn_*``): ``workers.handlers.tasks.detection.Detector``;
- semantic segmentation (``deeplabv3_*``, ``fcn_*``, ``lraspp_*``):
  ``workers.handlers.tasks.segmentation.SemanticSegmenter``.

``embedding:ARCH`` takes any classification architecture, loads its weights, and
replaces its last linear layer by an identity: ``workers.handlers.tasks.embedding.ImageEmbedder``.

Weights: a ``state_dict`` file (with ``PATH.labels.json`` when the model was trained
on other classes), else the published weights from torchvision's cache, or
``random`` for benchmarks (the version says so). Labels, keypoint names and the
reference input transform come from torchvision's weights metadata, which is part
of its source: reading it downloads nothing.

``options`` are keyword arguments for torchvision's model builder (e.g. ``min_size``,
``box_score_thresh``, ``box_detections_per_img`` for detectors), plus two handler
options: ``score_threshold`` (detection: the requests' default) and ``resize_size``
(segmentation: the shorter side the model takes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image

from schemas import Limits
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.decode.images import ImageSpec
from workers.handlers.base import Handler, ImageClassifier
from workers.handlers.weights import (
    RANDOM_WEIGHTS,
    ModelLoadError,
    load_state_dict,
    read_state_dict,
    require_file,
    sha256,
    sidecar_labels,
    torchvision_cached,
)

Kind = Literal["classification", "detection", "segmentation"]
Preprocess = Literal["auto", "reference", "fast"]


@dataclass(frozen=True)
class Serving:
    """How the model is served, whatever its task."""

    device: torch.device
    dtype: torch.dtype  # classifiers run in it; detectors and segmenters autocast to it
    channels_last: bool | None  # None: on for classifiers and embeddings on CUDA only
    limits: Limits
    decode: DecodeOption
    decode_budget: DecodeBudget | None  # bounds the memory of CPU decodes running at once
    preprocess: Preprocess  # for fixed-size image models; auto means reference here
    options: Mapping[str, Any]


@dataclass(frozen=True)
class _Weights:
    file: Path | None  # None: random
    source: str  # for the version: the published name, random-weights or the file's hash
    labels: list[str]


def load_torchvision(
    arch: str, *, embedding: bool, weights: str | None, serving: Serving
) -> Handler:
    """The handler for torchvision architecture ``arch`` (see the module doc).

    Raises ``ModelLoadError`` naming the spec for an unknown architecture, weights that
    are missing or do not fit, or options the builder refuses.
    """
    import torchvision

    spec = f"{'embedding' if embedding else 'torchvision'}:{arch}"
    kind = _kind(spec, arch, embedding)
    # Architectures with published weights carry their labels and input transform as
    # metadata inside torchvision; reading it downloads nothing.
    published = torchvision.models.get_model_weights(arch).DEFAULT
    found = _resolve_weights(spec, arch, weights, published)
    if kind == "classification":
        return _classifier(spec, arch, embedding, found, published, serving)
    if serving.preprocess == "fast":
        raise ModelLoadError(
            f"{spec}: preprocess='fast' is for models of a fixed input size (classifiers, "
            "embeddings); this model resizes images itself. Leave preprocess at auto"
        )
    if kind == "detection":
        return _detector(spec, arch, found, published, serving)
    return _segmenter(spec, arch, found, published, serving)


def _kind(spec: str, arch: str, embedding: bool) -> Kind:
    import torchvision.models as models

    if arch in models.list_models(module=models):
        return "classification"
    if embedding:
        raise ModelLoadError(
            f"{spec}: embeddings come from classification architectures (resnet50, "
            f"vit_b_16, ...); {arch!r} is not one"
        )
    if arch in models.list_models(module=models.detection):
        return "detection"
    if arch in models.list_models(module=models.segmentation):
        return "segmentation"
    known = sorted(
        models.list_models(module=models)
        + models.list_models(module=models.detection)
        + models.list_models(module=models.segmentation)
    )
    raise ModelLoadError(
        f"{spec}: no torchvision classification, detection or segmentation model is called "
        f"{arch!r}; known ones include {', '.join(known[:12])}, ... (docs/models.md lists them)"
    )


def _resolve_weights(spec: str, arch: str, weights: str | None, published: Any) -> _Weights:
    labels: list[str] = list(published.meta["categories"])
    if weights is None:
        return _Weights(torchvision_cached(spec, published.url), published.name, labels)
    if weights == RANDOM_WEIGHTS:
        return _Weights(None, "random-weights", labels)
    file = Path(weights)
    require_file(spec, file)
    # A fine-tuned model names its own classes; the architecture is sized to them.
    return _Weights(file, f"sha256-{sha256(file)[:12]}", sidecar_labels(file) or labels)


def _build(
    spec: str, arch: str, ours: Mapping[str, Any], options: Mapping[str, Any]
) -> torch.nn.Module:
    """The architecture with random weights, built with our keyword arguments and the
    user's ``options``, which must all be ones the model takes."""
    import torchvision

    builder = torchvision.models.get_model_builder(arch)
    kwargs = {**ours, **options}
    try:
        module: torch.nn.Module = builder(weights=None, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{spec}: torchvision's {arch} builder refused the model options {kwargs}: {exc}"
        ) from exc
    # Detection and segmentation builders pass unknown keywords on to classes that
    # drop them: a misspelt option would do nothing, silently.
    known = _parameters(builder) | _parameters(type(module).__init__)
    transform = getattr(module, "transform", None)
    if transform is not None:
        known |= _parameters(type(transform).__init__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ModelLoadError(
            f"{spec}: torchvision's {arch} takes no model option {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(known))}"
        )
    return module


def _parameters(function: Callable[..., Any]) -> set[str]:
    """The keyword names ``function`` declares (not ``*args``, ``**kwargs`` or ``self``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind in kinds and p.name != "self"}


def _pop_option(
    spec: str,
    options: dict[str, Any],
    name: str,
    valid: Callable[[Any], bool],
    default: Any,
    what: str,
) -> Any:
    """A handler option taken out of the builder's options, checked; ``default`` if absent."""
    if name not in options:
        return default
    value = options.pop(name)
    if not valid(value):
        raise ModelLoadError(f"{spec}: model option {name} must be {what}, not {value!r}")
    return value


def _is_fraction(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1


def _is_size(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def _classifier(
    spec: str, arch: str, embedding: bool, found: _Weights, published: Any, serving: Serving
) -> Handler:
    from workers.handlers.tasks.embedding import ImageEmbedder, remove_head

    transform = published.transforms()
    crop, resize = transform.crop_size[0], transform.resize_size[0]
    image = ImageSpec(
        height=crop,
        width=crop,
        mode="RGB",
        crop_ratio=crop / resize,
        resample=Image.Resampling[transform.interpolation.name],
        fit="fast" if serving.preprocess == "fast" else "reference",
    )
    module = _build(spec, arch, {"num_classes": len(found.labels)}, serving.options)
    if found.file is not None:
        load_state_dict(spec, module, found.file)
    name = f"{arch}-embedding" if embedding else arch
    common: dict[str, Any] = {
        "name": name,
        "version": f"{name}:{found.source}",
        "image": image,
        "mean": transform.mean,
        "std": transform.std,
        "device": serving.device,
        "dtype": serving.dtype,
        "channels_last": _channels_last(serving, fixed_size=True),
        "limits": serving.limits,
        "decode": serving.decode,
        "decode_budget": serving.decode_budget,
    }
    if not embedding:
        return ImageClassifier(module, labels=found.labels, **common)
    try:
        remove_head(module, len(found.labels))
    except ValueError as exc:
        raise ModelLoadError(f"{spec}: cannot take the head off {arch}: {exc}") from exc
    return ImageEmbedder(module, **common)


def _detector(spec: str, arch: str, found: _Weights, published: Any, serving: Serving) -> Handler:
    from torchvision.models.detection import KeypointRCNN, MaskRCNN

    from workers.handlers.tasks.detection import DEFAULT_SCORE_THRESHOLD, Detector
    from workers.handlers.tasks.detection import Task as DetectionTask

    options = dict(serving.options)
    threshold = _pop_option(
        spec, options, "score_threshold", _is_fraction, DEFAULT_SCORE_THRESHOLD, "from 0 to 1"
    )
    keypoint_names: list[str] = list(published.meta.get("keypoint_names", []))
    kwargs: dict[str, Any] = {"num_classes": len(found.labels), "weights_backbone": None}
    if keypoint_names:
        kwargs["num_keypoints"] = len(keypoint_names)
    module = _build(spec, arch, kwargs, options)
    if found.file is not None:
        load_state_dict(spec, module, found.file)
    task: DetectionTask = "detection"
    if isinstance(module, MaskRCNN):
        task = "instance_segmentation"
    elif isinstance(module, KeypointRCNN):
        task = "keypoints"
    return Detector(
        module,
        name=arch,
        version=f"{arch}:{found.source}",
        labels=found.labels,
        task=task,
        keypoint_names=keypoint_names,
        device=serving.device,
        dtype=serving.dtype,
        channels_last=_channels_last(serving, fixed_size=False),
        limits=serving.limits,
        decode=serving.decode,
        decode_budget=serving.decode_budget,
        score_threshold=float(threshold),
    )


def _segmenter(spec: str, arch: str, found: _Weights, published: Any, serving: Serving) -> Handler:
    from workers.handlers.tasks.segmentation import SemanticSegmenter

    transform = published.transforms()
    options = dict(serving.options)
    default_size = transform.resize_size[0] if transform.resize_size else None
    resize_size = _pop_option(
        spec, options, "resize_size", _is_size, default_size, "a positive integer or null"
    )
    kwargs: dict[str, Any] = {"num_classes": len(found.labels), "weights_backbone": None}
    state = read_state_dict(spec, found.file) if found.file is not None else None
    if state is not None and any(key.startswith("aux_classifier.") for key in state):
        kwargs["aux_loss"] = True  # published DeepLabV3 and FCN weights carry one
    module = _build(spec, arch, kwargs, options)
    if found.file is not None:
        load_state_dict(spec, module, found.file, state)
    if getattr(module, "aux_classifier", None) is not None:
        module.register_module("aux_classifier", None)  # a training aid: skip it when serving
    return SemanticSegmenter(
        module,
        name=arch,
        version=f"{arch}:{found.source}",
        labels=found.labels,
        mean=transform.mean,
        std=transform.std,
        resize_size=resize_size,
        device=serving.device,
        dtype=serving.dtype,
        channels_last=_channels_last(serving, fixed_size=False),
        limits=serving.limits,
        decode=serving.decode,
        decode_budget=serving.decode_budget,
    )


def _channels_last(serving: Serving, *, fixed_size: bool) -> bool:
    """Channels-last pays off for batches of one fixed shape on tensor cores; models that
    stack images of their own making keep the default layout unless asked."""
    if serving.channels_last is not None:
        return serving.channels_last
    return fixed_size and serving.device.type == "cuda"
