"""Cutting a parent's boxes out of its image: one PNG per child request.

The image is decoded again from the parent's payload, on the CPU, as the detector's
full-size decode does it (``workers.decode.images.decode_full``, in RGB), so a box in
the answer's pixels is a box in these. Each box grows by its margin, is clamped to the
image and rounded outwards to whole pixels; the crop is written as PNG, so the next
model sees exactly these pixels. Pure functions, safe to run in a thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from schemas.headers import ContentType
from workers.decode.images import decode_full

Box = Sequence[float]


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


def cut(
    payload: bytes,
    content_type: ContentType,
    boxes: Sequence[Box],
    margin: float,
    *,
    max_pixels: int,
) -> list[bytes]:
    """The PNG of each box of the image in ``payload``, in the order of ``boxes``."""
    if not boxes:
        return []
    pixels = decode_full(payload, content_type, "RGB", max_pixels=max_pixels)
    image = np.ascontiguousarray(pixels.permute(1, 2, 0).numpy())
    height, width = image.shape[:2]
    crops = []
    for box in boxes:
        left, top, right, bottom = pixel_box(box, margin, width, height)
        buffer = io.BytesIO()
        Image.fromarray(image[top:bottom, left:right]).save(buffer, format="PNG", compress_level=1)
        crops.append(buffer.getvalue())
    return crops
