"""What the served == direct comparisons share: photo-like test images, random-weight
detectors made to behave like trained ones where it matters, and how served
detections agree with direct ones.

The tolerances are those docs/models.md states; tests/unit/test_served_equals_direct.py
explains them and why random weights need calibrating, and the detector worker's
integration test holds a real worker to the same agreement.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torchvision.transforms.functional import to_tensor

BOX_TOLERANCE_PX = 0.01
SCORE_TOLERANCE = 1e-3
MIN_STRICT_SHARE = 0.995
# A few image sizes recur (as frames of a few cameras would), the rest are all different.
_SIZES = ((48, 64), (64, 48), (56, 56), (40, 72), (72, 40), (64, 64))


def photo_like(seed: int) -> bytes:
    """A PNG of blurred coloured shapes on a gradient, of a size the seed picks."""
    rng = np.random.default_rng(seed)
    if seed % 3:
        width, height = _SIZES[seed % len(_SIZES)]
    else:
        width, height = (int(v) for v in rng.integers(32, 97, 2))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    ramps = rng.uniform(-60, 200, (3, 3))
    base = np.stack([a + b * x / width + c * y / height for a, b, c in ramps], axis=-1)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(5):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        side = rng.uniform(0.15, 0.5) * width
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.ellipse((x0, y0, x0 + side, y0 + side * rng.uniform(0.5, 1.5)), fill=colour)
    buffer = io.BytesIO()
    image.filter(ImageFilter.GaussianBlur(1.0)).save(buffer, format="PNG")
    return buffer.getvalue()


def pil(payload: bytes) -> Image.Image:
    return Image.open(io.BytesIO(payload)).convert("RGB")


def calibrate(module: torch.nn.Module, run: Callable[[], object]) -> None:
    """Set ``module``'s batch-norm statistics from what ``run`` feeds it, as training
    would have (see the module doc); ``module`` is in eval mode afterwards."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the calibration batch
        norm.train()
    with torch.no_grad():
        run()
    for norm in norms:
        norm.eval()


def calibrate_detector(module: Any, payloads: Sequence[bytes]) -> None:
    """Calibrate an R-CNN's backbone and spread its objectness and class scores."""

    def run() -> None:
        batch, _ = module.transform([to_tensor(pil(p)) for p in payloads])
        module.backbone(batch.tensors)

    calibrate(module, run)
    sharpen(module.rpn.head.cls_logits, 0.5)
    sharpen(module.roi_heads.box_predictor.cls_score, 0.5)


def sharpen(layer: torch.nn.Module, std: float) -> None:
    """Redraw a scoring layer's weights at a larger scale (see the module doc)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    with torch.no_grad():
        weight.normal_(0.0, std, generator=torch.Generator().manual_seed(1))


@dataclass
class Agreement:
    """How served detections compare with direct ones, over many images."""

    pairs: int = 0
    strict: list[tuple[dict[str, Any], int, Mapping[str, torch.Tensor]]] = field(
        default_factory=list
    )  # pairs with boxes within BOX_TOLERANCE_PX: served detection, index in the direct
    # output, that output

    def add(
        self, answer: Mapping[str, Any], direct: Mapping[str, torch.Tensor], floor: float
    ) -> None:
        """Pair every served detection of one image with a direct one: the same label,
        scores within SCORE_TOLERANCE, the closest box. A detection left over on either
        side must score within SCORE_TOLERANCE of the model's score floor."""
        boxes, scores = direct["boxes"].numpy(), direct["scores"].numpy()
        labels = direct["labels"].numpy()
        free = set(range(len(boxes)))
        for detection in sorted(answer["detections"], key=lambda d: -d["score"]):
            box = np.array(detection["box"])
            gaps = {
                j: (float(np.abs(boxes[j] - box).max()), abs(float(scores[j]) - detection["score"]))
                for j in free
                if labels[j] == detection["index"]
            }
            near = [j for j, (_, score_gap) in gaps.items() if score_gap <= SCORE_TOLERANCE]
            if not near:
                assert detection["score"] - floor <= SCORE_TOLERANCE, f"{detection} not direct"
                continue
            j = min(near, key=lambda k: gaps[k])
            free.remove(j)
            self.pairs += 1
            box_gap, _ = gaps[j]
            if box_gap <= BOX_TOLERANCE_PX:
                self.strict.append((detection, j, direct))
        left = [float(scores[j]) for j in free]
        assert all(s - floor <= SCORE_TOLERANCE for s in left), f"direct scores {left} not served"

    def check(self, at_least: int) -> None:
        assert self.pairs >= at_least, "too few detections for the comparison to count"
        assert len(self.strict) / self.pairs >= MIN_STRICT_SHARE, (len(self.strict), self.pairs)
