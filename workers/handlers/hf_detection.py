"""``hf:`` object detectors (``--task object-detection``): RT-DETR and its kin.

The config's architectures say ``...ForObjectDetection``; the model is built by
transformers' ``AutoModelForObjectDetection`` (``workers.handlers.hf_models``) and served
by ``workers.handlers.tasks.detr.DetrDetector``. Served are set-prediction models that
score classes with a sigmoid (``use_focal_loss``: RT-DETR, RT-DETRv2) at a fixed input
size. Labels come from the config's ``id2label``.

The input follows the folder's image processor config (``preprocessor_config.json``)
where there is one: ``size`` (a fixed ``height`` and ``width``), ``resample``,
``do_rescale`` with ``rescale_factor`` 1/255, ``do_normalize`` with ``image_mean`` and
``image_std``. Without one, RT-DETR's own: 640x640, bilinear, rescaled, not normalized.
A processor that keeps images at their own sizes (``shortest_edge``), or pads them to
another size, is refused: the model's input would not be one size. The model option
``score_threshold`` sets the requests' default, as torchvision's detectors take it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from workers.decode.images import ImageSpec
from workers.handlers.tasks.detection import DEFAULT_SCORE_THRESHOLD
from workers.handlers.tasks.detr import DetrDetector
from workers.handlers.torchvision_models import Serving
from workers.handlers.weights import ModelLoadError

PROCESSOR_FILE = "preprocessor_config.json"
RTDETR_PROCESSOR: dict[str, Any] = {
    "do_resize": True,
    "size": {"height": 640, "width": 640},
    "resample": int(Image.Resampling.BILINEAR),
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": False,
}
"""RT-DETR's image processor settings (transformers' ``RTDetrImageProcessor`` defaults),
for a folder that has no processor config."""


def load_detector(
    spec: str,
    module: torch.nn.Module,
    folder: Path,
    names: tuple[str, str],
    labels: list[str],
    serving: Serving,
    dtype: torch.dtype,
) -> DetrDetector:
    """``module`` served as ``names`` (name, version) with the folder's preprocessing.

    Raises ``ModelLoadError`` for a model that is not served (its scores are not
    sigmoids) and an image processor config that does not make one input size."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_focal_loss", False):
        raise ModelLoadError(
            f"{spec}: {type(module).__name__} scores classes with a softmax (DETR); served "
            "are detectors of sigmoid scores at a fixed size (RT-DETR, RT-DETRv2)"
        )
    processor = read_processor(spec, folder)
    image, mean, std = processor_input(spec, processor)
    name, version = names
    return DetrDetector(
        module,
        score_threshold=score_threshold(spec, serving.options),
        name=name,
        version=version,
        labels=labels,
        image=image,
        mean=mean,
        std=std,
        device=serving.device,
        dtype=dtype,
        limits=serving.limits,
        decode=serving.decode,
        decode_budget=serving.decode_budget,
    )


def score_threshold(spec: str, options: Mapping[str, Any]) -> float:
    """The model option ``score_threshold`` (the requests' default, from 0 to 1), as
    torchvision's detectors take it; a request's own ``score_threshold`` wins."""
    unknown = set(options) - {"score_threshold"}
    if unknown:
        raise ModelLoadError(
            f"{spec}: model options {sorted(unknown)} do not apply "
            "(a detector takes score_threshold)"
        )
    value = options.get("score_threshold", DEFAULT_SCORE_THRESHOLD)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ModelLoadError(
            f"{spec}: model option score_threshold must be from 0 to 1, not {value!r}"
        )
    return float(value)


def read_processor(
    spec: str, folder: Path, defaults: Mapping[str, Any] = RTDETR_PROCESSOR
) -> dict[str, Any]:
    """The folder's image processor settings over ``defaults`` (RT-DETR's), or the
    defaults alone where it has none."""
    file = folder / PROCESSOR_FILE
    if not file.is_file():
        return dict(defaults)
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{spec}: cannot read {file}: {exc}") from exc
    if not isinstance(found, dict):
        raise ModelLoadError(f"{spec}: {file} is not a JSON object")
    return {**defaults, **found}


def processor_input(
    spec: str, processor: dict[str, Any]
) -> tuple[ImageSpec, tuple[float, ...], tuple[float, ...]]:
    """The ``ImageSpec`` (resized to the fixed size, each side by its own factor) and the
    normalization (mean, std of pixels in [0, 1]) an image processor config asks for."""
    size = processor.get("size") or {}
    height, width = size.get("height"), size.get("width")
    if not processor.get("do_resize") or not isinstance(height, int) or not isinstance(width, int):
        raise ModelLoadError(
            f"{spec}: the image processor asks for size {size} (do_resize "
            f"{processor.get('do_resize')}); served are models of one input size, "
            '"size": {"height": H, "width": W}'
        )
    pad = processor.get("pad_size") or size
    if processor.get("do_pad") and (pad.get("height"), pad.get("width")) != (height, width):
        raise ModelLoadError(f"{spec}: the image processor pads to {pad}, not its size {size}")
    factor = processor.get("rescale_factor")
    if not processor.get("do_rescale") or not isinstance(factor, int | float):
        raise ModelLoadError(f"{spec}: served are models that take pixels rescaled by 1/255")
    if not math.isclose(factor, 1 / 255, rel_tol=1e-6):
        raise ModelLoadError(f"{spec}: rescale_factor {factor} is not 1/255")
    try:
        resample = Image.Resampling(int(processor.get("resample", Image.Resampling.BILINEAR)))
    except ValueError as exc:
        raise ModelLoadError(f"{spec}: resample {processor.get('resample')!r}: {exc}") from exc
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    if processor.get("do_normalize"):
        mean = tuple(float(v) for v in processor.get("image_mean", mean))
        std = tuple(float(v) for v in processor.get("image_std", std))
    # "reference" with squash: Pillow's resize of the whole image to (width, height), the
    # call transformers' processor makes on a uint8 image.
    image = ImageSpec(
        height=height, width=width, mode="RGB", resample=resample, fit="reference", squash=True
    )
    return image, mean, std
