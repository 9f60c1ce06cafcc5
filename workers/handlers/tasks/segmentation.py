"""Semantic segmentation: a class for every pixel, torchvision's segmentation models.

``SemanticSegmenter`` serves a module that maps a normalized float (N, C, H, W) batch
to per-class scores at the input's resolution (a tensor, or a dict whose ``out`` is
one: torchvision's DeepLabV3, FCN and LR-ASPP). Each image is prepared on the device
exactly as the weights' reference transform prepares a tensor image (torchvision's
``resize`` of the shorter side with antialiasing, then scaling and ``normalize``: the
same function calls), images that come out the same shape run as one batch
(``workers.handlers.tasks.groups``), and each image's scores are resized back to its submitted
size (bilinear) before the per-pixel argmax: the label map has the submitted image's
pixels. Results are ``conveyor.semantic_segmentation.v1`` documents.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from schemas import DEFAULT_LIMITS, Limits
from schemas.outputs import SEMANTIC_SEGMENTATION_V1
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.handlers.base import DeviceInput
from workers.handlers.tasks.full_size import FullSizeImageTask
from workers.handlers.tasks.groups import group_indices
from workers.handlers.tasks.params import SegmentationParams
from workers.handlers.tasks.rle import encode_columns

_PNG_LEVEL = 1  # label maps are runs of a few values: fast compression is nearly as small


class SemanticSegmenter(FullSizeImageTask):
    """A segmentation module served as a handler (see the module doc)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        labels: Sequence[str],
        mean: Sequence[float],
        std: Sequence[float],
        resize_size: int | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        decode: DecodeOption = "auto",
        decode_budget: DecodeBudget | None = None,
        mode: Literal["RGB", "L"] = "RGB",
    ) -> None:
        """Wrap ``module`` (moved to ``device``, in eval mode).

        ``labels`` names the module's classes in output order; ``resize_size`` is the
        shorter side's length the model takes (torchvision's weights: 520), ``None`` to
        take images as submitted; ``mean``/``std`` normalize the scaled pixels.
        ``dtype`` other than float32 runs the forward under autocast; ``decode`` and
        ``decode_budget`` are as for ``ImageModel``.
        """
        if not labels:
            raise ValueError("a segmentation model needs at least one label")
        super().__init__(
            module,
            name=name,
            version=version,
            labels=labels,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            decode=decode,
            decode_budget=decode_budget,
            mode=mode,
        )
        self.resize_size = resize_size
        self.mean = list(mean)
        self.std = list(std)
        self._channels_last = channels_last

    def check_params(self, params: Mapping[str, Any]) -> None:
        SegmentationParams.parse(params, self.labels)

    def prepare(self, image: torch.Tensor) -> torch.Tensor:
        """One uint8 (C, H, W) image as the module's float input: the weights' transform."""
        from torchvision.transforms import functional

        if self.resize_size is not None:
            image = functional.resize(image, [self.resize_size], antialias=True)
        scaled = functional.convert_image_dtype(image, torch.float32)
        normalized: torch.Tensor = functional.normalize(scaled, mean=self.mean, std=self.std)
        return normalized

    def forward(self, batch: DeviceInput) -> list[torch.Tensor]:
        """Each image's label map: a (H, W) tensor of class indices at its submitted size."""
        images = list(batch)
        inputs = [self.prepare(image) for image in images]
        maps: list[torch.Tensor] = [images[0]] * len(images)  # every entry is replaced
        for group in group_indices([tuple(x.shape) for x in inputs]):
            stacked = torch.stack([inputs[i] for i in group])
            if self._channels_last:
                stacked = stacked.contiguous(memory_format=torch.channels_last)
            with self._precision():
                scores = self.module(stacked)
            if isinstance(scores, Mapping):
                scores = scores["out"]
            for row, i in enumerate(group):
                full = torch.nn.functional.interpolate(
                    scores[row : row + 1].float(),
                    size=images[i].shape[-2:],
                    mode="bilinear",
                    align_corners=False,
                )
                maps[i] = full[0].argmax(dim=0)
        return maps

    def postprocess(
        self, outputs: Sequence[torch.Tensor], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        return [
            self._document(label_map, SegmentationParams.parse(p, self.labels))
            for label_map, p in zip(outputs, params, strict=True)
        ]

    def _document(self, label_map: torch.Tensor, params: SegmentationParams) -> dict[str, Any]:
        small = len(self.labels) <= 256
        pixels = label_map.to(torch.uint8 if small else torch.int32).cpu().numpy()
        height, width = pixels.shape
        counts = np.bincount(pixels.reshape(-1), minlength=len(self.labels))
        present = [
            int(index)
            for index in np.argsort(-counts, kind="stable")
            if counts[index] and (params.classes is None or index in params.classes)
        ]
        classes: list[dict[str, Any]] = [
            {"index": index, "label": self._label(index), "pixels": int(counts[index])}
            for index in present
        ]
        document: dict[str, Any] = {
            "type": SEMANTIC_SEGMENTATION_V1,
            "width": width,
            "height": height,
            "map": None,
            "classes": classes,
        }
        if params.format == "png":
            document["map"] = {"encoding": "png", "data": _png(pixels, small)}
        else:
            columns = pixels.T  # the encoding's order: column by column
            for segment in classes:
                counts_text = encode_columns(columns == segment["index"], 0, width)
                segment["mask"] = {"size": [height, width], "counts": counts_text}
        return document

    def _label(self, index: int) -> str:
        return self.labels[index] if index < len(self.labels) else str(index)


def _png(pixels: npt.NDArray[Any], small: bool) -> str:
    """A grayscale PNG of class indices, base64: 8-bit, or 16-bit past 256 classes."""
    image = Image.fromarray(pixels if small else pixels.astype(np.uint16))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=_PNG_LEVEL)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
