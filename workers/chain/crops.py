"""Cutting a parent's boxes out of its image: one crop per child request.

The image is the one the first model saw (``Item.tensor``): the full-size uint8 image
its handler's ``preprocess`` decoded, or the one its batch decoder made on the card
(``ModelRunner(keep_images=True)`` copies it back after the forward), when it has the
size the answer gives, so a box in the answer's pixels is a box in these, in the
model's colour mode, with no second decode; else (an image still encoded, one the
handler resized) those bytes, or the record's payload, decoded again as the CPU path
decodes them (``workers.decode.images.decode_full``, in RGB). Each box grows
by its margin, is clamped to the image and rounded outwards to whole pixels.

A crop is sent as ``.npy`` (uint8 (H, W, 3) or (H, W)): the same pixels as PNG, written
in 0.04 ms where PNG took 10 ms for a 300x250 crop (88 ms for the four crops of a
640x480 photo, which bound a detector serving 218 images/s on one H200 to the CPU;
docs/bench-log, 2026-11-29). A crop whose ``.npy`` is larger than the next model's
topic takes goes as PNG (level 1), which is smaller. Either way the next model sees
exactly these pixels. Pure functions, safe to run in a thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from schemas.headers import ContentType
from workers.decode.images import decode_full

Box = Sequence[float]
Pixels = npt.NDArray[np.uint8]  # (H, W, C) or (H, W)


class Crop(NamedTuple):
    """One encoded crop: the child request's ``content-type`` and value."""

    content_type: ContentType
    data: bytes


def pixel_box(box: Box, margin: float, width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` (x1, y1, x2, y2 in image pixels) grown by ``margin`` of its size on each
    side, clamped to the image and rounded outwards; at least one pixel each way."""
    x1, y1, x2, y2 = box
    dx, dy = (x2 - x1) * margin, (y2 - y1) * margin
    left = min(max(math.floor(x1 - dx), 0), width - 1)
    top = min(max(math.floor(y1 - dy), 0), height - 1)
    right = max(min(math.ceil(x2 + dx), width), left + 1)
    bottom = max(min(math.ceil(y2 + dy), height), top + 1)
    return left, top, right, bottom


def decoded(preprocessed: Any) -> Pixels | None:
    """The image a full-size handler's ``preprocess`` made (a uint8 (C, H, W) tensor on
    the CPU, C 1 or 3), as (H, W, C) or (H, W) pixels; None for anything else."""
    if not (
        isinstance(preprocessed, torch.Tensor)
        and preprocessed.dtype == torch.uint8
        and preprocessed.device.type == "cpu"
        and preprocessed.dim() == 3
        and preprocessed.shape[0] in (1, 3)
    ):
        return None
    pixels = preprocessed.permute(1, 2, 0).numpy()
    return np.ascontiguousarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)


def encoded(preprocessed: Any, payload: bytes) -> bytes:
    """The image's encoded bytes: those a handler kept for the card's JPEG decoder (a
    uint8 1-D tensor), else ``payload``."""
    if (
        isinstance(preprocessed, torch.Tensor)
        and preprocessed.dtype == torch.uint8
        and preprocessed.device.type == "cpu"
        and preprocessed.dim() == 1
    ):
        return preprocessed.numpy().tobytes()
    return payload


def cut_pixels(
    pixels: Pixels, boxes: Sequence[Box], margin: float, *, limit: int, size: int | None = None
) -> list[Crop]:
    """The crop of each box of ``pixels``, in the order of ``boxes``, as ``.npy`` when
    that is at most ``limit`` bytes, else as PNG; with ``size``, each resized (bilinear,
    keeping its shape) so its longer side is at most ``size``."""
    height, width = pixels.shape[:2]
    crops = []
    for box in boxes:
        left, top, right, bottom = pixel_box(box, margin, width, height)
        crop = pixels[top:bottom, left:right]
        longest = max(crop.shape[:2])
        if size is not None and longest > size:
            image = Image.fromarray(np.ascontiguousarray(crop))
            scale = size / longest
            shape = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            crop = np.asarray(image.resize(shape, Image.Resampling.BILINEAR))
        crops.append(encode(crop, limit))
    return crops


def encode(pixels: Pixels, limit: int) -> Crop:
    """``pixels`` as ``.npy`` when that takes at most ``limit`` bytes, else as PNG."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(pixels), allow_pickle=False)
    if buffer.tell() <= limit:
        return Crop(ContentType.NPY, buffer.getvalue())
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="PNG", compress_level=1)
    return Crop(ContentType.PNG, buffer.getvalue())


def cut(
    payload: bytes,
    content_type: ContentType,
    boxes: Sequence[Box],
    margin: float,
    *,
    max_pixels: int,
    limit: int,
    size: int | None = None,
) -> list[Crop]:
    """The crop of each box of the image in ``payload`` (decoded in RGB)."""
    if not boxes:
        return []
    pixels = decode_full(payload, content_type, "RGB", max_pixels=max_pixels)
    image = np.ascontiguousarray(pixels.permute(1, 2, 0).numpy())
    return cut_pixels(image, boxes, margin, limit=limit, size=size)


def cut_from(
    preprocessed: Any,
    payload: bytes,
    content_type: ContentType,
    boxes: Sequence[Box],
    margin: float,
    *,
    max_pixels: int,
    limit: int,
    size: int | None = None,
    shape: tuple[int, int] | None = None,
) -> list[Crop]:
    """The crop of each box of the image the first model saw (see the module doc).

    ``shape`` is the submitted image's (width, height) as the answer gives it: the image
    the handler decoded is used only when it has that size (a handler that resized it
    keeps pixels the boxes do not describe)."""
    pixels = decoded(preprocessed)
    if pixels is not None and shape is not None and pixels.shape[1::-1] == shape:
        return cut_pixels(pixels, boxes, margin, limit=limit, size=size)
    data = encoded(preprocessed, payload)
    return cut(data, content_type, boxes, margin, max_pixels=max_pixels, limit=limit, size=size)
