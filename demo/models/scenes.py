"""Scenes the demo detector learns from and is measured on: digits drawn on a noisy canvas.

Nothing can be downloaded where the demo runs, so the detector learns from
scenes drawn here: scikit-learn's 8x8 digits (split as the demo classifier
splits them), scaled to 18-40 pixels and tinted, on a dark noisy 160x120
canvas, each with the true box of every digit. The video demo draws its frames
with the same functions.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from PIL import Image

from demo.models.digits import PIXEL_STEP, digit_pixels, heldout_indices

CANVAS = (160, 120)
"""Width and height of the training scenes (and of the demo video's frames)."""
DIGIT_SIZES = (18, 40)
"""Smallest and largest side of a digit in a scene, in pixels."""

Box = tuple[float, float, float, float, int]
"""A true digit in a scene: ``(x1, y1, x2, y2, value)``."""


@dataclass(frozen=True)
class Placement:
    """One digit in a scene."""

    digit: int  # row of the digit set the scene draws from
    x: int  # left edge, pixels
    y: int  # top edge, pixels
    size: int  # side of the scaled 8x8 digit, pixels
    colour: tuple[float, float, float]  # RGB in [0, 1]


@dataclass(frozen=True)
class DigitSet:
    """Digits to draw scenes from: 8x8 pixels in [0, 1] and their values."""

    pixels: torch.Tensor  # (N, 8, 8) float
    values: npt.NDArray[np.int64]

    @classmethod
    def load(cls, heldout: bool) -> DigitSet:
        """The demo classifier's held-out digits, or the rest (its training split)."""
        rows = heldout_indices()
        if not heldout:
            everything = np.arange(len(digit_pixels()[1]))
            rows = np.setdiff1d(everything, rows)
        pixels, values = digit_pixels(rows)
        return cls(pixels[:, 0].float() / (16 * PIXEL_STEP), values.numpy())


def draw_scene(
    digits: DigitSet,
    placements: list[Placement],
    background: tuple[float, float, float],
    rng: np.random.Generator,
) -> tuple[torch.Tensor, list[Box]]:
    """A float (3, H, W) canvas in [0, 1] and each digit's ``(x1, y1, x2, y2, value)``
    box: the tight box of its visible strokes."""
    width, height = CANVAS
    base = torch.tensor(background).view(3, 1, 1)
    noise = torch.from_numpy(rng.normal(0.0, 0.03, (3, height, width)).astype(np.float32))
    canvas = (base + noise).clamp(0, 1)
    boxes = []
    for p in placements:
        glyph = F.interpolate(
            digits.pixels[p.digit][None, None],
            size=(p.size, p.size),
            mode="bilinear",
            align_corners=False,
        )[0, 0]
        tinted = glyph[None] * torch.tensor(p.colour).view(3, 1, 1)
        region = canvas[:, p.y : p.y + p.size, p.x : p.x + p.size]
        canvas[:, p.y : p.y + p.size, p.x : p.x + p.size] = torch.maximum(region, tinted)
        ys, xs = torch.nonzero(glyph > 0.25, as_tuple=True)
        boxes.append(
            (
                float(p.x + xs.min()),
                float(p.y + ys.min()),
                float(p.x + xs.max() + 1),
                float(p.y + ys.max() + 1),
                int(digits.values[p.digit]),
            )
        )
    return canvas, boxes


def random_scene(digits: DigitSet, rng: np.random.Generator) -> tuple[torch.Tensor, list[Box]]:
    """One to four digits at random places (never overlapping), sizes and tints."""
    width, height = CANVAS
    placed: list[Placement] = []
    for _ in range(int(rng.integers(1, 5))):
        size = int(rng.integers(DIGIT_SIZES[0], DIGIT_SIZES[1] + 1))
        for _attempt in range(30):
            x, y = int(rng.integers(0, width - size)), int(rng.integers(0, height - size))
            if all(_apart(x, y, size, q) for q in placed):
                placed.append(
                    Placement(int(rng.integers(len(digits.values))), x, y, size, _tint(rng))
                )
                break
    return draw_scene(digits, placed, _background(rng), rng)


def as_jpeg(image: torch.Tensor, quality: int) -> torch.Tensor:
    """A float (3, H, W) image in [0, 1] after a JPEG round trip at ``quality``."""
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    with Image.open(buffer) as decoded:
        back = torch.from_numpy(np.asarray(decoded.convert("RGB")).copy())
    return back.permute(2, 0, 1).float() / 255


def _apart(x: int, y: int, size: int, other: Placement) -> bool:
    return (
        x + size <= other.x
        or x >= other.x + other.size
        or y + size <= other.y
        or y >= other.y + other.size
    )


def _tint(rng: np.random.Generator) -> tuple[float, float, float]:
    red, green, blue = rng.uniform(0.6, 1.0, 3)
    return float(red), float(green), float(blue)


def _background(rng: np.random.Generator) -> tuple[float, float, float]:
    red, green, blue = rng.uniform(0.0, 0.25, 3)
    return float(red), float(green), float(blue)
