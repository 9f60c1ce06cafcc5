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
on other classes); published weights by name (``DEFAULT`` or a name of the
architecture's weights enum, ``IMAGENET1K_V2``), downloaded through torchvision's own
``get_state_dict`` when they are not in torch hub's cache (``workers.handlers.published``);
``random`` for benchmarks (the version says so); none: the default published weights
if torch hub's cache holds them, never a download. Labels, keypoint names and the
reference input transform come from the metadata of the weights served (the default
ones for a file or ``random``), which is part of torchvision's source: reading it
downloads nothing.

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
from workers.handlers.published import torch_hub_cached, torch_hub_download
from workers.handlers.weights import (
    RANDOM_WEIGHTS,
    ModelLoadError,
    load_state_dict,
    read_state_dict,
    sha256,
    sidecar_labels,
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

    def fixed_size(self) -> dict[str, Any]:
        """The keyword arguments of a fixed-size ``ImageModel`` (a classifier, an embedder,
        a tower) that come from how it is served, as given (channels-last off when unset)."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "channels_last": bool(self.channels_last),
            "limits": self.limits,
            "decode": self.decode,
            "decode_budget": self.decode_budget,
        }


@dataclass(frozen=True)
class _Weights:
    published: Any  # the weights enum entry whose metadata (labels, transform) applies
    file: Path | None  # None: random
    source: str  # for the version: the published name, random-weights or the file's hash
    labels: list[str]
    state: dict[str, Any] | None = None  # the file's tensors, when already read


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
    if serving.preprocess == "fast" and kind != "classification":
        raise ModelLoadError(
            f"{spec}: preprocess='fast' is for models of a fixed input size (classifiers, "
            "embeddings); this model resizes images itself. Leave preprocess at auto"
        )
    # Architectures with published weights carry their labels and input transform as
    # metadata inside torchvision; reading it downloads nothing.
    found = _resolve_weights(spec, weights, torchvision.models.get_model_weights(arch))
    if kind == "classification":
        return _classifier(spec, arch, embedding, found, serving)
    if kind == "detection":
        return _detector(spec, arch, found, serving)
    return _segmenter(spec, arch, found, serving)


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


def _resolve_weights(spec: str, weights: str | None, enum: Any) -> _Weights:
    """What ``weights`` names: published weights by name (downloaded unless cached), the
    default published ones from the cache (``None``), ``random``, or a file."""
    if weights in enum.__members__:  # DEFAULT, IMAGENET1K_V2, ...: the names come first
        entry = enum[weights]
        # torchvision's own download: progress bar, checksum, torch hub's cache.
        state = torch_hub_download(
            spec, entry.url, lambda: entry.get_state_dict(progress=True, check_hash=True)
        )
        return _Weights(entry, torch_hub_cached(spec, entry.url), entry.name, _labels(entry), state)
    default = enum.DEFAULT
    if weights is None:
        file = torch_hub_cached(spec, default.url)
        return _Weights(default, file, default.name, _labels(default))
    if weights == RANDOM_WEIGHTS:
        return _Weights(default, None, "random-weights", _labels(default))
    file = Path(weights)
    if not file.is_file():
        raise ModelLoadError(
            f"{spec}: {file} does not exist or is not a file, nor is it the name of published "
            f"weights ({', '.join(sorted(enum.__members__, key=lambda n: n != 'DEFAULT'))}: "
            "downloaded when named)"
        )
    # A fine-tuned model names its own classes; the architecture is sized to them.
    return _Weights(
        default, file, f"sha256-{sha256(file)[:12]}", sidecar_labels(file) or _labels(default)
    )


def _labels(entry: Any) -> list[str]:
    return list(entry.meta["categories"])


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
    spec: str, arch: str, embedding: bool, found: _Weights, serving: Serving
) -> Handler:
    from workers.handlers.tasks.embedding import ImageEmbedder, remove_head

    transform = found.published.transforms()
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
        load_state_dict(spec, module, found.file, found.state)
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


def _detector(spec: str, arch: str, found: _Weights, serving: Serving) -> Handler:
    from torchvision.models.detection import KeypointRCNN, MaskRCNN

    from workers.handlers.tasks.detection import DEFAULT_SCORE_THRESHOLD, Detector
    from workers.handlers.tasks.detection import Task as DetectionTask

    options = dict(serving.options)
    threshold = _pop_option(
        spec, options, "score_threshold", _is_fraction, DEFAULT_SCORE_THRESHOLD, "from 0 to 1"
    )
    keypoint_names: list[str] = list(found.published.meta.get("keypoint_names", []))
    kwargs: dict[str, Any] = {"num_classes": len(found.labels), "weights_backbone": None}
    if keypoint_names:
        kwargs["num_keypoints"] = len(keypoint_names)
    module = _build(spec, arch, kwargs, options)
    if found.file is not None:
        load_state_dict(spec, module, found.file, found.state)
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


def _segmenter(spec: str, arch: str, found: _Weights, serving: Serving) -> Handler:
    from workers.handlers.tasks.segmentation import SemanticSegmenter

    transform = found.published.transforms()
    options = dict(serving.options)
    default_size = transform.resize_size[0] if transform.resize_size else None
    resize_size = _pop_option(
        spec, options, "resize_size", _is_size, default_size, "a positive integer or null"
    )
    kwargs: dict[str, Any] = {"num_classes": len(found.labels), "weights_backbone": None}
    state = found.state
    if state is None and found.file is not None:
        state = read_state_dict(spec, found.file)
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
