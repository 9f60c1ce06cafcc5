"""``timm:NAME``: a timm image classifier as a handler (the optional ``timm`` extra).

NAME is what ``timm.create_model`` takes: an architecture (``resnet18``,
``vit_tiny_patch16_224``), or one with a pretrained tag (``convnext_atto.d2_in1k``);
without a tag, timm's default tag for it. The tag names the published weights and
their data config.

Preprocessing follows timm's data config for the model
(``timm.data.resolve_model_data_config``): its input size, interpolation, mean and std,
and its crop (``crop_pct``, ``crop_mode``). ``reference`` makes the pixels of timm's
evaluation transform (``timm.data.create_transform``): resize the shorter side (both
sides for ``crop_mode="squash"``) to ``floor(size / crop_pct)``, then crop the centre;
``fast`` cuts the same region and resizes it in one pass (``workers.decode.images``).
Models of a non-square input, or cropped another way (``crop_mode="border"``), are
refused.

Weights: ``random`` (benchmarks: the version says so); a ``state_dict`` file (``.pt``
or ``.safetensors``, with ``PATH.labels.json`` when the model was trained on other
classes); ``DEFAULT``, the tag's published weights, downloaded when they are not cached
(``workers.handlers.published``); or none: the published weights when a download
already put them in the cache, never a download. Published weights are loaded by
timm's own ``load_pretrained`` (its checkpoint filters, its loaders for other formats).

Labels: ImageNet's class descriptions from timm's ImageNet info (``tabby, tabby cat``)
for models of one of its class sets (``timm.data.infer_imagenet_subset``), else the
class indices as strings.

``options`` are keyword arguments of ``timm.create_model`` (``img_size``, ...), except
``num_classes``, which follows the labels; the data config reads those that size the
input (``img_size``, ``in_chans``) as timm's own scripts do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from common.install import install_hint
from workers.decode.images import Fit, ImageSpec
from workers.handlers.base import ImageClassifier
from workers.handlers.published import (
    DEFAULT_WEIGHTS,
    hf_cached,
    hf_download,
    hub_file,
    torch_hub_download,
    torch_hub_fetch,
)
from workers.handlers.torchvision_models import Serving
from workers.handlers.weights import (
    RANDOM_WEIGHTS,
    ModelLoadError,
    load_state_dict,
    sha256,
    sidecar_labels,
)

# The names timm tries on the Hub, safetensors first (as its own loader does).
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def load_timm(name: str, *, weights: str | None, serving: Serving) -> ImageClassifier:
    """The handler for timm model ``name`` (see the module doc).

    Raises ``ModelLoadError`` naming the spec when timm is not installed, for an unknown
    model or tag, a model whose preprocessing cannot be served or that has no classifier
    (checked before anything is built or downloaded), weights that are missing or do not
    fit, and options the model refuses.
    """
    spec = f"timm:{name}"
    timm = _import_timm(spec)
    if "num_classes" in serving.options:
        raise ModelLoadError(
            f"{spec}: the model option num_classes follows the labels: the published ones, "
            "or those of a weights file's PATH.labels.json; leave it unset"
        )
    config = _pretrained_config(spec, timm, name)
    fit: Fit = "fast" if serving.preprocess == "fast" else "reference"
    # timm's data config reads the options that size the input (img_size) as its scripts do.
    image_spec(spec, timm.data.resolve_data_config(serving.options, pretrained_cfg=config), fit)
    file = None if weights in (None, RANDOM_WEIGHTS, DEFAULT_WEIGHTS) else Path(str(weights))
    labels = None  # a weights file's own, from its sidecar
    if file is not None:
        _require_weights_file(spec, file)
        labels = sidecar_labels(file)
    if config.get("num_classes") == 0 and not labels:
        raise ModelLoadError(
            f"{spec}: this model has no classifier (num_classes 0: a feature extractor); "
            "serve a tag with a classification head, or weights with a head and their labels"
        )
    options = {**serving.options, **({"num_classes": len(labels)} if labels else {})}
    module, source = _model(spec, timm, name, config, weights, file, options)
    data = timm.data.resolve_model_data_config(module, serving.options)
    architecture = config["architecture"]
    return ImageClassifier(
        module,
        name=architecture,
        version=f"{architecture}:{source}",
        labels=labels or _labels(timm, module),
        image=image_spec(spec, data, fit),
        mean=data["mean"],
        std=data["std"],
        **serving.fixed_size(),
    )


def _model(
    spec: str,
    timm: Any,
    name: str,
    config: dict[str, Any],
    weights: str | None,
    file: Path | None,
    options: dict[str, Any],
) -> tuple[torch.nn.Module, str]:
    """The model with the weights asked for, and what the version calls them."""
    if weights == RANDOM_WEIGHTS:
        return _create(spec, timm, name, options), "random-weights"
    if file is None:  # the published weights
        found = _published_file(spec, config, download=weights == DEFAULT_WEIGHTS)
        overlay = {"pretrained_cfg_overlay": {"file": str(found)}}
        return _create(spec, timm, name, options, **overlay), config["tag"]
    module = _create(spec, timm, name, options)
    load_state_dict(spec, module, file)
    return module, f"sha256-{sha256(file)[:12]}"


def _import_timm(spec: str) -> Any:
    try:
        import timm
        import timm.data
    except ImportError as exc:
        raise ModelLoadError(
            f"{spec}: timm is not installed; install the timm extra: {install_hint('timm')}"
        ) from exc
    return timm


def _pretrained_config(spec: str, timm: Any, name: str) -> dict[str, Any]:
    """timm's pretrained config of ``name``'s tag (its default tag without one): where its
    weights are published, its data config, its number of classes."""
    architecture, _, tag = name.partition(".")
    if not timm.is_model(architecture):
        near = timm.list_models(f"*{architecture[:5]}*")[:8]
        hint = f"; similar names: {', '.join(near)}" if near else ""
        raise ModelLoadError(f"{spec}: timm has no model {architecture!r}{hint}")
    try:
        config = timm.models.get_pretrained_cfg(name)
    except RuntimeError as exc:  # a tag the architecture does not have
        tags = [n.partition(".")[2] for n in timm.list_models(architecture, pretrained=True)]
        raise ModelLoadError(
            f"{spec}: timm has no pretrained tag {tag!r} for {architecture}; "
            f"its tags: {', '.join(tags) or 'none'}"
        ) from exc
    found: dict[str, Any] = config.to_dict() if config is not None else {}
    found.setdefault("architecture", architecture)
    found["tag"] = found.get("tag") or tag or "untagged"
    return found


def _published_file(spec: str, config: dict[str, Any], *, download: bool) -> Path:
    """The tag's published weights file: from the cache, or downloaded when ``download``."""
    repo: str | None = config.get("hf_hub_id")
    url: str | None = config.get("url")
    if repo:  # where a tag has both, timm takes the Hub's
        filename = config.get("hf_hub_filename")
        filenames = (filename,) if filename else _HF_WEIGHTS
        if download:
            return hf_download(spec, repo, filenames)
        cached, where = hf_cached(repo, filenames), f"{repo} on the Hugging Face Hub"
    elif url:
        if download:
            return torch_hub_download(spec, url, lambda: torch_hub_fetch(url))
        file = hub_file(url)
        cached, where = (file if file.is_file() else None), f"{url}, cached as {file}"
    else:
        raise ModelLoadError(f"{spec}: timm publishes no weights for this model and tag")
    if cached is None:
        raise ModelLoadError(
            f"{spec}: no weights given and the published ones ({where}) are not in the "
            "cache, and nothing is downloaded unless asked. Pass weights='DEFAULT' to "
            "download them, weights=PATH (a state_dict file, .safetensors too), or "
            "weights='random' for a benchmark whose outputs mean nothing"
        )
    return cached


def _create(spec: str, timm: Any, name: str, options: dict[str, Any], **more: Any) -> Any:
    """``timm.create_model``, loading the published file ``more`` names, if any; the
    model options it refuses, or a file that does not fit, as ``ModelLoadError``."""
    pretrained = "pretrained_cfg_overlay" in more
    try:
        module: torch.nn.Module = timm.create_model(name, pretrained=pretrained, **options, **more)
    except TypeError as exc:
        raise ModelLoadError(f"{spec}: timm refused the model options {options}: {exc}") from exc
    except (RuntimeError, ValueError, OSError) as exc:
        what = f"weights from {more['pretrained_cfg_overlay']['file']}" if pretrained else "it"
        raise ModelLoadError(f"{spec}: timm cannot load {what}: {exc}") from exc
    return module


def _require_weights_file(spec: str, file: Path) -> None:
    if not file.is_file():
        raise ModelLoadError(
            f"{spec}: {file} does not exist or is not a file; the published weights are "
            "weights='DEFAULT' (downloaded when not cached), of the tag the name ends with"
        )


def _labels(timm: Any, module: Any) -> list[str]:
    """The names of the classes ``module`` scores (see the module doc)."""
    classes = int(module.num_classes)
    subset = timm.data.infer_imagenet_subset(module)
    if subset is None:
        return [str(i) for i in range(classes)]
    info = timm.data.ImageNetInfo(subset)
    return [info.index_to_description(i) for i in range(classes)]


def image_spec(spec: str, data: Mapping[str, Any], fit: Fit) -> ImageSpec:
    """timm's evaluation transform for ``data`` (a resolved data config) as an ``ImageSpec``
    fitting images the ``fit`` way."""
    _, height, width = data["input_size"]
    mode = data.get("crop_mode") or "center"
    if height != width or mode not in ("center", "squash"):
        raise ModelLoadError(
            f"{spec}: timm's data config asks for a {width}x{height} input cropped by "
            f"crop_mode={mode!r}; only square inputs cropped by 'center' or 'squash' are "
            "served. Serve it with a handler class of your own (docs/models.md)"
        )
    # timm resizes to floor(size / crop_pct), then crops the centre.
    resize = math.floor(height / data["crop_pct"])
    try:
        resample = Image.Resampling[str(data["interpolation"]).upper()]
    except KeyError as exc:
        raise ModelLoadError(
            f"{spec}: timm's interpolation {data['interpolation']!r} has no Pillow equivalent"
        ) from exc
    return ImageSpec(
        height=height,
        width=width,
        mode="RGB",
        crop_ratio=height / resize,
        resample=resample,
        fit=fit,
        squash=mode == "squash",
    )
