"""``hf:`` image models: classifiers (``--task image-classification``) and CLIP/SigLIP
dual encoders (``--task image-text-embedding``).

The config's architectures say ``...ForImageClassification`` (ViT, DeiT, BEiT,
DINOv2 with a head, ...) or ``CLIPModel`` / ``SiglipModel``; the models are built by
``workers.handlers.hf_models``. A classifier is served by ``ImageClassifier`` (the
result document of every image classifier, labels from the config's ``id2label``),
a dual encoder by ``workers.handlers.tasks.dual_encoder.DualEncoder``.

The input follows the folder's image processor config (``preprocessor_config.json``,
which ``save_pretrained`` of the image processor writes; a folder without one is
refused, since each model family has its own defaults): ``size`` either a fixed
``height`` and ``width`` (each side resized by its own factor) or a ``shortest_edge``
(the aspect ratio kept); ``do_center_crop`` with ``crop_size``; ``resample``;
``do_rescale`` with ``rescale_factor`` 1/255; ``do_normalize`` with ``image_mean`` and
``image_std``. Images are fitted with Pillow on the decode threads (``reference``, or
``fast`` with ``--preprocess fast``), where transformers' processors resize with
torchvision on tensors: docs/models.md states the difference measured.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from workers.decode.images import Fit, ImageSpec
from workers.handlers.base import ImageClassifier, ImageModel
from workers.handlers.hf_detection import PROCESSOR_FILE, read_processor
from workers.handlers.tasks.dual_encoder import DualEncoder, features
from workers.handlers.torchvision_models import Serving
from workers.handlers.weights import ModelLoadError

_PATCH = 16  # the patch side of most CLIP and SigLIP image towers
Names = tuple[str, str]
"""A handler's name and version."""


class Logits(torch.nn.Module):
    """A transformers image classifier as a module of pixels to logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(pixel_values=pixel_values).logits
        return logits


def load_image_classifier(
    spec: str,
    module: torch.nn.Module,
    folder: Path,
    names: Names,
    labels: list[str],
    serving: Serving,
) -> ImageClassifier:
    """``module`` (a ``...ForImageClassification``) served with the folder's preprocessing.

    Raises ``ModelLoadError`` for a missing or unserved image processor config."""
    image, mean, std = processor_input(spec, _processor(spec, folder), _fit(serving))
    name, version = names
    return ImageClassifier(
        Logits(module),
        name=name,
        version=version,
        labels=labels,
        image=image,
        mean=mean,
        std=std,
        **serving.fixed_size(),
    )


class ImageTower(torch.nn.Module):
    """A dual encoder's image side as a module of pixels to its embeddings
    (``get_image_features``, projected, not normalized)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        get: Any = self.model.get_image_features  # transformers' decorators are untyped
        return features(get(pixel_values=pixel_values))


def load_dual_encoder(
    spec: str,
    module: torch.nn.Module,
    tokenizer: Any,
    folder: Path,
    names: Names,
    text: dict[str, Any],
    serving: Serving,
) -> DualEncoder:
    """``module`` (``CLIPModel``, ``SiglipModel``) served for both of its inputs: images
    as the folder's image processor prepares them, texts as ``tokenizer`` does.
    ``text`` holds ``TextModel``'s length settings (``max_length``, ``refuse_long``).

    SigLIP's text tower pools the last position, so its texts are padded to
    ``max_length`` (as its processor pads them), not to a length bucket. CLIP's pools
    at the config's ``eos_token_id``: the tokenizer must end a text with that token.
    Raises ``ModelLoadError`` for a processor config or a tokenizer that does not fit."""
    image, mean, std = processor_input(spec, _processor(spec, folder), _fit(serving))
    name, version = names
    config = getattr(module, "config", None)
    full_length = getattr(config, "model_type", None) == "siglip"
    if not full_length:
        _check_end_token(spec, config, tokenizer)
    images = ImageModel(
        ImageTower(module),
        name=name,
        version=version,
        image=image,
        mean=mean,
        std=std,
        **serving.fixed_size(),
    )
    return DualEncoder(
        module,
        tokenizer,
        images=images,
        full_length=full_length,
        image_cost=_image_tokens(module, image),
        name=name,
        version=version,
        device=serving.device,
        dtype=serving.dtype,
        **text,
    )


def _image_tokens(module: torch.nn.Module, image: ImageSpec) -> int:
    """The image tower's sequence length: its position embeddings (patches, plus CLIP's
    class token), else the input's patches of 16 pixels."""
    vision: Any = getattr(module, "vision_model", None)
    positions = getattr(getattr(vision, "embeddings", None), "num_positions", None)
    if isinstance(positions, int):
        return positions
    return (image.height // _PATCH) * (image.width // _PATCH)


def _check_end_token(spec: str, config: Any, tokenizer: Any) -> None:
    """CLIP's text tower pools at the first ``eos_token_id`` of a text (or, for the
    original checkpoints' ``eos_token_id`` 2, at its highest id): refuse a tokenizer that
    does not end a text there, whose embeddings would pool some other token."""
    text_config = getattr(config, "text_config", None)
    eos = getattr(text_config, "eos_token_id", None)
    ids = tokenizer("a photo")["input_ids"]
    if eos is None or not ids:
        return
    if eos == 2:  # transformers' rule for the original CLIP configs: argmax of the ids
        if ids[-1] != max(ids) or ids.count(ids[-1]) != 1:
            raise ModelLoadError(
                f"{spec}: the text config's eos_token_id 2 pools the highest token id, but "
                f"the tokenizer ends a text with {ids[-1]}; set eos_token_id to its end token"
            )
        return
    if ids[-1] != eos or ids.count(eos) != 1:
        raise ModelLoadError(
            f"{spec}: the text tower pools at eos_token_id {eos}, but the tokenizer ends a "
            f"text with {ids[-1]} ({ids}); set the text config's eos_token_id to its end token"
        )


def _fit(serving: Serving) -> Fit:
    return "fast" if serving.preprocess == "fast" else "reference"


def _processor(spec: str, folder: Path) -> dict[str, Any]:
    if not (folder / PROCESSOR_FILE).is_file():
        raise ModelLoadError(
            f"{spec}: {folder} has no {PROCESSOR_FILE}; save the model's image processor "
            "with it (processor.save_pretrained(folder)): it says how images are resized"
        )
    return read_processor(spec, folder, {})


def processor_input(
    spec: str, processor: dict[str, Any], fit: Fit = "reference"
) -> tuple[ImageSpec, tuple[float, ...], tuple[float, ...]]:
    """The ``ImageSpec`` and normalization (mean, std of pixels in [0, 1]) of an image
    processor config that resizes to a fixed size, or to a shortest edge and then crops
    the centre (see the module doc)."""
    if not processor.get("do_resize", False):
        raise ModelLoadError(f"{spec}: the image processor does not resize: no one input size")
    if processor.get("crop_pct") is not None or processor.get("do_pad"):
        raise ModelLoadError(
            f"{spec}: the image processor's crop_pct or do_pad is not served (served: size "
            "height/width or shortest_edge, with or without crop_size)"
        )
    resample = _resample(spec, processor)
    size = {k: v for k, v in (processor.get("size") or {}).items() if v is not None}
    crop = None
    if processor.get("do_center_crop"):
        crop = _height_width(spec, "crop_size", processor.get("crop_size") or {})
    if set(size) == {"shortest_edge"} and crop is not None:
        image = _shortest_edge(spec, int(size["shortest_edge"]), crop, resample, fit)
    elif set(size) == {"height", "width"}:
        image = _fixed(spec, _height_width(spec, "size", size), crop, resample, fit)
    else:
        raise ModelLoadError(
            f"{spec}: the image processor asks for size {size} (crop {crop}); served are "
            '"size": {"height": H, "width": W}, or {"shortest_edge": S} with a centre crop'
        )
    mean, std = _normalization(spec, processor)
    return image, mean, std


def _height_width(spec: str, key: str, size: dict[str, Any]) -> tuple[int, int]:
    height, width = size.get("height"), size.get("width")
    if not isinstance(height, int) or not isinstance(width, int) or height < 1 or width < 1:
        raise ModelLoadError(f"{spec}: the image processor's {key} {size} has no height and width")
    return height, width


def _shortest_edge(
    spec: str, short: int, crop: tuple[int, int], resample: Image.Resampling, fit: Fit
) -> ImageSpec:
    height, width = crop
    if max(height, width) > short:
        raise ModelLoadError(
            f"{spec}: the image processor crops {height}x{width} out of a {short}-pixel "
            "shortest edge; served are crops inside the resized image"
        )
    # ImageSpec resizes the shorter side to round(min(height, width) / crop_ratio).
    image = ImageSpec(
        height=height,
        width=width,
        mode="RGB",
        crop_ratio=min(height, width) / short,
        resample=resample,
        fit=fit,
        floor_crop=True,
    )
    assert image.resize_size == short
    return image


def _fixed(
    spec: str,
    size: tuple[int, int],
    crop: tuple[int, int] | None,
    resample: Image.Resampling,
    fit: Fit,
) -> ImageSpec:
    height, width = crop or size
    ratio = height / size[0]
    if crop is not None and round(width / ratio) != size[1]:
        raise ModelLoadError(
            f"{spec}: the image processor resizes to {size[0]}x{size[1]} and crops "
            f"{height}x{width}: a crop of another aspect ratio is not served"
        )
    return ImageSpec(
        height=height,
        width=width,
        mode="RGB",
        crop_ratio=ratio,
        resample=resample,
        fit=fit,
        squash=True,
        floor_crop=True,
    )


def _resample(spec: str, processor: dict[str, Any]) -> Image.Resampling:
    try:
        return Image.Resampling(int(processor.get("resample", Image.Resampling.BILINEAR)))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{spec}: resample {processor.get('resample')!r}: {exc}") from exc


def _normalization(
    spec: str, processor: dict[str, Any]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    factor = processor.get("rescale_factor")
    if not processor.get("do_rescale") or not isinstance(factor, int | float):
        raise ModelLoadError(f"{spec}: served are models that take pixels rescaled by 1/255")
    if not math.isclose(factor, 1 / 255, rel_tol=1e-6):
        raise ModelLoadError(f"{spec}: rescale_factor {factor} is not 1/255")
    if not processor.get("do_normalize"):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    mean, std = _channels(processor.get("image_mean")), _channels(processor.get("image_std"))
    if mean is None or std is None:
        raise ModelLoadError(
            f"{spec}: do_normalize needs image_mean and image_std, a number or 3 each, not "
            f"{processor.get('image_mean')} and {processor.get('image_std')}"
        )
    return mean, std


def _channels(value: object) -> tuple[float, ...] | None:
    """A per-channel value of a processor config (one number stands for all three)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    if not isinstance(value, list) or len(value) != 3:
        return None
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    return None
