"""The corpora the stages run on, synthesised from seeds: nothing is downloaded.

Photo-like images (``synthetic_jpeg``), a ``Corpus`` of one size, the corpora of a
run, the one each producer process rebuilds from the same seeds (``make_corpus``), the
text mix of ``bench.text`` as a corpus of ``text/plain`` requests (``text_corpus``), a
corpus by its name (``corpus_named``: what a producer process is told), and the
request records made of one.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from schemas import ContentType

_NOISE = 19.0  # sigma of the pixel noise: gives ~146 KB at 640x480 and ~25 KB at 224x224


TEXT_CORPUS = "text"
"""The name of the text mix's corpus (``text_corpus``)."""


@dataclass(frozen=True)
class Corpus:
    """Distinct payloads, JPEGs of one size or texts; benchmarks cycle through them."""

    name: str  # e.g. "640x480", or TEXT_CORPUS
    width: int  # 0 for texts
    height: int
    payloads: tuple[bytes, ...]
    content_type: ContentType = ContentType.JPEG

    @property
    def mean_kb(self) -> float:
        return sum(map(len, self.payloads)) / len(self.payloads) / 1000

    def take(self, count: int) -> list[bytes]:
        return [self.payloads[n % len(self.payloads)] for n in range(count)]


def synthetic_jpeg(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG: gradients, blurred shapes and sensor-like noise.

    Pure noise would compress far worse than photos and flat colour far better; this
    lands near real photos' sizes at quality 90 (~0.48 bytes per pixel).
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    ramps = rng.uniform(-80, 160, (3, 3))
    base = np.stack([a + b * x / width + c * y / height for a, b, c in ramps], axis=-1)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        side = rng.uniform(0.05, 0.3) * width
        box = (x0, y0, x0 + side, y0 + side * rng.uniform(0.5, 1.5))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    smooth = np.asarray(image.filter(ImageFilter.GaussianBlur(1.0)), dtype=np.float32)
    pixels = np.clip(smooth + rng.normal(0, _NOISE, smooth.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def build_corpora(distinct: int, names: Sequence[str] = ("640x480", "224x224")) -> list[Corpus]:
    sizes = [tuple(int(n) for n in name.split("x")) for name in names]
    return [
        Corpus(f"{w}x{h}", w, h, tuple(synthetic_jpeg(w, h, seed) for seed in range(distinct)))
        for w, h in sizes
    ]


def _records(
    corpus: Corpus, ids: Sequence[str], params: Mapping[str, Any] | None = None
) -> list[Any]:
    from schemas import encode_request

    return [
        encode_request(
            p, request_id=i, content_type=corpus.content_type, source="bench.gpu", params=params
        )
        for p, i in zip(corpus.take(len(ids)), ids, strict=True)
    ]


def make_corpus(width: int, height: int) -> Corpus:
    """The corpus every producer process rebuilds from the same seeds."""
    return Corpus(
        f"{width}x{height}",
        width,
        height,
        tuple(synthetic_jpeg(width, height, seed) for seed in range(64)),
    )


TEXT_COUNT = 2000
"""Distinct texts of the text corpus: ``bench.text``'s default mix."""


def text_corpus() -> Corpus:
    """``bench.text``'s long-tailed mix of texts (its module doc says the rule), as
    ``text/plain`` requests."""
    from bench.text import texts  # torch with it: only a text load pays the import

    return Corpus(TEXT_CORPUS, 0, 0, tuple(texts(TEXT_COUNT)), ContentType.TEXT)


def corpus_named(name: str) -> Corpus:
    """The corpus a producer process rebuilds from its name: ``TEXT_CORPUS``, or ``WxH``
    JPEGs from ``make_corpus``'s seeds."""
    if name == TEXT_CORPUS:
        return text_corpus()
    width, _, height = name.partition("x")
    return make_corpus(int(width), int(height))
