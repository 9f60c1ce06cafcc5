"""The two fits of ``ImageSpec`` compared: pixels, top-1 agreement and throughput.

    python -m bench.preprocess [--images 500] [--out docs/preprocess-bench.json]

- pixels: 500 images cut from scikit-learn's two bundled photos (random crops, each
  resized to a random size from 64 to 1600 pixels on its longer side, saved as JPEG at
  quality 70-95 or as PNG), fitted to torchvision's ImageNet input (resize 256, crop
  224) by ``fast`` and by ``reference``: the difference in grey levels.
- top-1 agreement, two models. The demo digits CNN (trained, 98% held-out accuracy)
  on its 360 held-out digits drawn at 16-128 pixels (JPEG and PNG), fitted to 8x8 both
  ways: agreement and accuracy of each. And ResNet-18 with random weights whose
  batch-norm statistics are measured on the photos (no pretrained weights can be
  downloaded here): how often the pixel differences alone flip a deep network's top
  class; its outputs mean nothing else.
- throughput: decode + fit on one thread, images per second, for a 640x480 JPEG, a
  1920x1080 JPEG and a 640x480 PNG.

Nothing is downloaded; everything is generated from data inside scikit-learn.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from demo.models.digits import DigitsClassifier, heldout_digits
from schemas import DEFAULT_LIMITS, ContentType
from workers.decode.images import ImageSpec, decode
from workers.model.loader import IMAGENET_IMAGE, IMAGENET_MEAN, IMAGENET_STD

MAX_PIXELS = DEFAULT_LIMITS.max_pixels
_SEED = 500


def photo_corpus(count: int) -> list[tuple[bytes, ContentType]]:
    """``count`` JPEG and PNG images cut from scikit-learn's sample photos."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(pixels) for pixels in load_sample_images().images]
    rng = np.random.default_rng(_SEED)
    corpus = []
    for n in range(count):
        photo = photos[n % len(photos)]
        width = int(rng.integers(photo.width // 4, photo.width + 1))
        height = int(rng.integers(photo.height // 4, photo.height + 1))
        left = int(rng.integers(0, photo.width - width + 1))
        top = int(rng.integers(0, photo.height - height + 1))
        cut = photo.crop((left, top, left + width, top + height))
        longer = int(rng.integers(64, 1601))
        scale = longer / max(cut.size)
        cut = cut.resize(
            (max(1, round(cut.width * scale)), max(1, round(cut.height * scale))),
            Image.Resampling.LANCZOS,
        )
        buffer = io.BytesIO()
        if n % 3 == 2:
            cut.save(buffer, format="PNG")
            corpus.append((buffer.getvalue(), ContentType.PNG))
        else:
            cut.save(buffer, format="JPEG", quality=int(rng.integers(70, 96)))
            corpus.append((buffer.getvalue(), ContentType.JPEG))
    return corpus


def pixel_deviation(corpus: list[tuple[bytes, ContentType]]) -> dict[str, Any]:
    fast, reference = _specs(IMAGENET_IMAGE)
    means, p99s, maxima = [], [], []
    for payload, content_type in corpus:
        a = decode(payload, content_type, fast, max_pixels=MAX_PIXELS).int()
        b = decode(payload, content_type, reference, max_pixels=MAX_PIXELS).int()
        diff = (a - b).abs().float()
        means.append(float(diff.mean()))
        p99s.append(float(diff.quantile(0.99)))
        maxima.append(float(diff.max()))
    return {
        "images": len(corpus),
        "mean_abs_levels": float(np.mean(means)),
        "p99_abs_levels_median_image": float(np.median(p99s)),
        "max_abs_levels_median_image": float(np.median(maxima)),
        "max_abs_levels": float(np.max(maxima)),
    }


def digits_agreement() -> dict[str, Any]:
    """The demo digits CNN on held-out digits drawn larger, fitted back to 8x8 both ways."""
    handler = DigitsClassifier()
    fast, reference = _specs(handler.image)
    rng = np.random.default_rng(_SEED)
    rows: dict[str, list[torch.Tensor]] = {"fast": [], "reference": []}
    truth = []
    for png, digit in heldout_digits():
        image = Image.open(io.BytesIO(png))
        for fmt in ("PNG", "JPEG"):
            size = int(rng.integers(16, 129))
            aspect = float(rng.uniform(0.8, 1.25))
            drawn = image.resize((size, max(8, round(size * aspect))), Image.Resampling.BICUBIC)
            buffer = io.BytesIO()
            drawn.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            content_type = ContentType.PNG if fmt == "PNG" else ContentType.JPEG
            for name, spec in (("fast", fast), ("reference", reference)):
                rows[name].append(
                    decode(buffer.getvalue(), content_type, spec, max_pixels=MAX_PIXELS)
                )
            truth.append(digit)
    with torch.inference_mode():
        top1 = {name: handler.forward(torch.stack(items)).argmax(1) for name, items in rows.items()}
    expected = torch.tensor(truth)
    return {
        "model": "digits-cnn-v1 (trained)",
        "images": len(truth),
        "top1_agreement": float((top1["fast"] == top1["reference"]).float().mean()),
        "accuracy_fast": float((top1["fast"] == expected).float().mean()),
        "accuracy_reference": float((top1["reference"] == expected).float().mean()),
    }


def random_network_agreement(corpus: list[tuple[bytes, ContentType]]) -> dict[str, Any]:
    """ResNet-18 with random weights and measured batch-norm statistics (module doc)."""
    import torchvision

    from workers.handlers.base import ImageModel

    torch.manual_seed(_SEED)
    module = torchvision.models.resnet18(weights=None)
    fast, reference = _specs(IMAGENET_IMAGE)
    inputs = {
        name: torch.stack([decode(p, t, spec, max_pixels=MAX_PIXELS) for p, t in corpus])
        for name, spec in (("fast", fast), ("reference", reference))
    }
    model = ImageModel(
        module, name="resnet18", version="random", image=reference,
        mean=IMAGENET_MEAN, std=IMAGENET_STD,
    )  # fmt: skip
    norms = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    with torch.no_grad():
        model.forward(inputs["reference"][:64])
    module.eval()
    with torch.inference_mode():
        top1 = {
            name: torch.cat([model.forward(chunk).argmax(1) for chunk in torch.split(batch, 50)])
            for name, batch in inputs.items()
        }
    return {
        "model": "resnet18, random weights, batch-norm statistics measured on the photos",
        "images": len(corpus),
        "top1_agreement": float((top1["fast"] == top1["reference"]).float().mean()),
        "distinct_top1_classes": len(set(top1["reference"].tolist())),
    }


def throughput(seconds: float) -> dict[str, Any]:
    from sklearn.datasets import load_sample_images

    photo = Image.fromarray(load_sample_images().images[0])
    samples = {}
    for name, size, fmt in (
        ("640x480 JPEG", (640, 480), "JPEG"),
        ("1920x1080 JPEG", (1920, 1080), "JPEG"),
        ("640x480 PNG", (640, 480), "PNG"),
    ):
        buffer = io.BytesIO()
        photo.resize(size, Image.Resampling.LANCZOS).save(buffer, format=fmt, quality=90)
        samples[name] = (buffer.getvalue(), ContentType.JPEG if fmt == "JPEG" else ContentType.PNG)
    fast, reference = _specs(IMAGENET_IMAGE)
    out: dict[str, Any] = {}
    for name, (payload, content_type) in samples.items():
        for fit, spec in (("fast", fast), ("reference", reference)):
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                decode(payload, content_type, spec, max_pixels=MAX_PIXELS)
                count += 1
            out[f"{name} {fit}"] = count / (time.perf_counter() - start)
    return out


def _specs(spec: ImageSpec) -> tuple[ImageSpec, ImageSpec]:
    return replace(spec, fit="fast"), replace(spec, fit="reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preprocess", description=__doc__)
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput cell")
    parser.add_argument("--out", type=Path, default=Path(".run/preprocess-bench.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # decode throughput is per thread; models are small here
    corpus = photo_corpus(args.images)
    results = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread",
        "date": time.strftime("%Y-%m-%d"),
        "pixels": pixel_deviation(corpus),
        "digits": digits_agreement(),
        "random_resnet18": random_network_agreement(corpus),
        "throughput_img_s_one_thread": throughput(args.seconds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
