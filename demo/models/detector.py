"""The video demo's detector: digits on a canvas, found by a small CenterNet trained here.

Nothing can be downloaded where the demo runs, so the model learns from scenes it
draws itself: scikit-learn's 8x8 digits (the demo classifier's training split),
scaled to 18-40 pixels and tinted, on a dark noisy 160x120 canvas. The network is a
CenterNet (Zhou et al., "Objects as Points", 2019) small enough to train in well
under a minute on one CPU thread: a stride-8 convolutional body, a heatmap per digit
class whose peaks are objects, and a box size and sub-cell offset at each peak.

``DigitsCenterNet`` follows torchvision's detection interface (a list of float
images in, one dict of ``boxes``/``labels``/``scores`` per image out), so the worker
serves it with the same ``Detector`` handler as torchvision's detectors:
``conveyor worker --model workers.demo_detector:DigitsDetector``. The held-out
recall and precision (scenes of held-out digits, never trained on) are measured at
build time and stored with the weights; a build below ``MIN_RECALL`` or
``MIN_PRECISION`` fails instead of serving a bad model.

Build it with ``python -m workers.demo_detector [--force]``; the worker builds it on
first use.
"""

from __future__ import annotations

import argparse
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from schemas import DEFAULT_LIMITS, Limits
from workers.demo_model import PIXEL_STEP, digit_pixels, heldout_indices
from workers.gpu_decode import DecodeOption
from workers.tasks.detection import Detector

DETECTOR_VERSION = "digits-centernet-v1"
"""Reported as ``model_version``; bump it when the architecture or training changes."""
LABELS = [str(d) for d in range(10)]
CANVAS = (160, 120)
"""Width and height of the training scenes (and of the demo video's frames)."""
DIGIT_SIZES = (18, 40)
"""Smallest and largest side of a digit in a scene, in pixels."""
SCORE_THRESHOLD = 0.4
"""The handler's default ``score_threshold``, and the one the held-out figures use."""
MIN_RECALL = 0.85
MIN_PRECISION = 0.90

_FORMAT = "conveyor.digits-centernet/1"
_STRIDE = 8
_SEED = 2019
_STEPS = 500
_BATCH = 16
_LEARNING_RATE = 6e-3
_HELDOUT_SCENES = 200
_MAX_DETECTIONS = 20
# Served frames arrive as JPEGs, often cut from a compressed video: training scenes go
# through JPEG at a random quality (blocking, ringing, halved colour resolution) too.
_JPEG_QUALITIES = (60, 95)
SERVED_JPEG_QUALITY = 85
"""The quality ``conveyor stream`` sends frames at by default; held-out scenes use it."""


def _block(inputs: int, outputs: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, stride, dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
    )


class DigitsCenterNet(nn.Module):
    """A small CenterNet for digits, with torchvision's detection interface in eval mode."""

    def __init__(self, score_floor: float = 0.05) -> None:
        """``score_floor``: peaks scoring below it are never reported."""
        super().__init__()
        self.body = nn.Sequential(
            _block(3, 16, 2), _block(16, 32, 2), _block(32, 48, 2),  # stride 8
            _block(48, 48), _block(48, 48, dilation=2), _block(48, 48),
        )  # fmt: skip
        classes = nn.Conv2d(48, len(LABELS), 1)
        # Start from a low object prior, so the first steps do not drown in false peaks.
        assert classes.bias is not None
        nn.init.constant_(classes.bias, -2.2)
        self.heat = nn.Sequential(_block(48, 48), classes)
        self.box = nn.Conv2d(48, 4, 1)  # width and height in cells, x and y offset in the cell
        self.score_floor = score_floor
        self.detections_per_img = _MAX_DETECTIONS

    def heads(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Heatmap logits (N, 10, H/8, W/8) and box regressions (N, 4, H/8, W/8) of a
        float (N, 3, H, W) batch in [0, 1]."""
        features = self.body((images - 0.5) / 0.25)
        heat: torch.Tensor = self.heat(features)
        box: torch.Tensor = self.box(features)
        return heat, box

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """torchvision's detection interface: images of one size in, boxes in their pixels."""
        heat, box = self.heads(torch.stack(images))
        height, width = images[0].shape[-2:]
        return [self._decode(h, b, width, height) for h, b in zip(heat, box, strict=True)]

    def _decode(
        self, heat: torch.Tensor, box: torch.Tensor, width: int, height: int
    ) -> dict[str, torch.Tensor]:
        # One class per cell (the likeliest), then cells that top their 3x3 neighbourhood.
        score, label = heat.sigmoid().max(dim=0)
        peak = F.max_pool2d(score[None, None], 3, 1, 1)[0, 0] == score
        ys, xs = (peak & (score >= self.score_floor)).nonzero(as_tuple=True)
        order = score[ys, xs].argsort(descending=True)[: self.detections_per_img]
        ys, xs = ys[order], xs[order]
        size = box[:2, ys, xs].clamp(min=0) * _STRIDE
        centre_x = (xs + box[2, ys, xs]) * _STRIDE
        centre_y = (ys + box[3, ys, xs]) * _STRIDE
        boxes = torch.stack(
            [
                (centre_x - size[0] / 2).clamp(0, width),
                (centre_y - size[1] / 2).clamp(0, height),
                (centre_x + size[0] / 2).clamp(0, width),
                (centre_y + size[1] / 2).clamp(0, height),
            ],
            dim=1,
        )
        return {"boxes": boxes, "labels": label[ys, xs], "scores": score[ys, xs]}


class DigitsDetector(Detector):
    """The demo detector as a handler: ``--model workers.demo_detector:DigitsDetector``.

    ``weights`` is the artifact's path (default ``default_model_path()``); it is built
    if missing. Images of any size are taken as they are: a frame of the demo video's
    size is what the model was trained on.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        weights: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        decode: DecodeOption = "auto",
    ) -> None:
        artifact = _load(build_detector(Path(weights) if weights else None))
        with torch.device("meta"):
            module = DigitsCenterNet()
        module.load_state_dict(artifact["state_dict"], assign=True)
        super().__init__(
            module,
            name="digits-detector",
            version=DETECTOR_VERSION,
            labels=artifact["labels"],
            device=device,
            limits=limits,
            decode=decode,
            score_threshold=SCORE_THRESHOLD,
        )


# -- scenes ---------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, list[tuple[float, float, float, float, int]]]:
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


def random_scene(
    digits: DigitSet, rng: np.random.Generator
) -> tuple[torch.Tensor, list[tuple[float, float, float, float, int]]]:
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


# -- training -------------------------------------------------------------------------------


def default_model_path() -> Path:
    """``$CONVEYOR_MODEL_DIR/digits-centernet-v1.pt``, else ``.cache/models/`` here."""
    model_dir = os.environ.get("CONVEYOR_MODEL_DIR")
    root = Path(model_dir) if model_dir else Path(__file__).resolve().parents[1] / ".cache/models"
    return root / f"{DETECTOR_VERSION}.pt"


def build_detector(path: Path | None = None, *, force: bool = False) -> Path:
    """Train the detector and save it at ``path`` unless a current artifact is there.

    The artifact is a plain dict of tensors and metadata (``heldout_recall``,
    ``heldout_precision``, ``train_seconds``, ...), loadable with
    ``torch.load(weights_only=True)``, written to a temporary file and renamed.
    Raises ``RuntimeError`` when the held-out figures are below the minimums.
    """
    path = path or default_model_path()
    if not force and _is_current(path):
        return path
    threads = torch.get_num_threads()
    started, cpu_started = time.monotonic(), time.process_time()
    # One thread: a model this small gains nothing from a second, and on a busy machine
    # threads that wait on each other make training several times slower.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        torch.set_num_threads(1)
        try:
            module = _train(np.random.default_rng(_SEED))
            train_seconds = time.monotonic() - started
            train_cpu_seconds = time.process_time() - cpu_started
            recall, precision = evaluate(module, DigitSet.load(heldout=True), _HELDOUT_SCENES)
        finally:
            torch.set_num_threads(threads)
    if recall < MIN_RECALL or precision < MIN_PRECISION:
        raise RuntimeError(
            f"{DETECTOR_VERSION} found {recall:.1%} of the held-out digits at "
            f"{precision:.1%} precision, below {MIN_RECALL:.0%} / {MIN_PRECISION:.0%}; "
            f"the training recipe in {__name__} is broken"
        )
    artifact = {
        "format": _FORMAT,
        "version": DETECTOR_VERSION,
        "state_dict": {key: value.clone() for key, value in module.state_dict().items()},
        "labels": LABELS,
        "heldout_recall": recall,
        "heldout_precision": precision,
        "heldout_scenes": _HELDOUT_SCENES,
        "score_threshold": SCORE_THRESHOLD,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,  # what a core of its own would take
        "seed": _SEED,
        "torch_version": str(torch.__version__),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(artifact, partial)
    partial.replace(path)
    return path


def detector_metadata(path: Path | None = None) -> dict[str, Any]:
    """The artifact's metadata (everything but the weights), building it if needed."""
    artifact = _load(build_detector(path))
    return {key: value for key, value in artifact.items() if key != "state_dict"}


def _train(rng: np.random.Generator) -> DigitsCenterNet:
    digits = DigitSet.load(heldout=False)
    module = DigitsCenterNet()
    optimizer = torch.optim.AdamW(module.parameters(), lr=_LEARNING_RATE, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=_LEARNING_RATE, total_steps=_STEPS, pct_start=0.2
    )
    module.train()
    for _ in range(_STEPS):
        scenes = [random_scene(digits, rng) for _ in range(_BATCH)]
        images = torch.stack(
            [as_jpeg(image, int(rng.integers(*_JPEG_QUALITIES))) for image, _ in scenes]
        )
        heat, box = module.heads(images)
        loss = _loss(heat, box, [boxes for _, boxes in scenes])
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        schedule.step()
    return module.eval()


def _loss(
    heat: torch.Tensor,
    box: torch.Tensor,
    scenes: list[list[tuple[float, float, float, float, int]]],
) -> torch.Tensor:
    """CenterNet's loss: focal loss on Gaussian peaks at object centres, L1 on the box
    size (weighted 0.1, it is in cells) and offset at the centre cells."""
    target = torch.zeros_like(heat)
    size_target = torch.zeros_like(box)
    at_centre = torch.zeros(box.shape[0], 1, *box.shape[2:])
    rows = torch.arange(heat.shape[2]).view(-1, 1).float()
    cols = torch.arange(heat.shape[3]).view(1, -1).float()
    for n, boxes in enumerate(scenes):
        for x1, y1, x2, y2, value in boxes:
            cx, cy = (x1 + x2) / 2 / _STRIDE, (y1 + y2) / 2 / _STRIDE
            col, row = int(cx), int(cy)
            sigma = max(x2 - x1, y2 - y1) / _STRIDE / 6 + 0.3
            peak = torch.exp(-((cols - col) ** 2 + (rows - row) ** 2) / (2 * sigma**2))
            target[n, value] = torch.maximum(target[n, value], peak)
            size_target[n, :, row, col] = torch.tensor(
                [(x2 - x1) / _STRIDE, (y2 - y1) / _STRIDE, cx - col, cy - row]
            )
            at_centre[n, 0, row, col] = 1.0
    p = heat.sigmoid().clamp(1e-4, 1 - 1e-4)
    positive = target.eq(1).float()
    focal = -(
        torch.log(p) * (1 - p) ** 2 * positive
        + torch.log(1 - p) * p**2 * (1 - target) ** 4 * (1 - positive)
    ).sum()
    objects = at_centre.sum().clamp(min=1)
    weights = torch.tensor([0.1, 0.1, 1.0, 1.0]).view(1, 4, 1, 1)
    regression = ((box - size_target).abs() * weights * at_centre).sum()
    return (focal + regression) / objects


def evaluate(module: DigitsCenterNet, digits: DigitSet, scenes: int) -> tuple[float, float]:
    """Recall and precision at ``SCORE_THRESHOLD`` on random scenes of ``digits``, sent
    as JPEGs the way ``conveyor stream`` sends frames: a detection is right when its box
    overlaps a digit's by IoU >= 0.5 and its label is that digit's value."""
    rng = np.random.default_rng(_SEED + 1)
    drawn = [random_scene(digits, rng) for _ in range(scenes)]
    with torch.inference_mode():
        found = module([as_jpeg(image, SERVED_JPEG_QUALITY) for image, _ in drawn])
    right = wrong = total = 0
    for (_, truth), detections in zip(drawn, found, strict=True):
        keep = detections["scores"] >= SCORE_THRESHOLD
        hits = match(detections["boxes"][keep].tolist(), detections["labels"][keep].tolist(), truth)
        right += hits
        wrong += int(keep.sum()) - hits
        total += len(truth)
    return right / max(total, 1), right / max(right + wrong, 1)


def match(
    boxes: list[list[float]],
    labels: list[int],
    truth: list[tuple[float, float, float, float, int]],
) -> int:
    """How many detections find a distinct true digit: IoU >= 0.5 and the same value."""
    found = 0
    unmatched = list(truth)
    for box, label in zip(boxes, labels, strict=True):
        best = max(unmatched, key=lambda t: iou(box, t[:4]), default=None)
        if best is not None and iou(box, best[:4]) >= 0.5 and best[4] == label:
            unmatched.remove(best)
            found += 1
    return found


def iou(a: Any, b: Any) -> float:
    """Intersection over union of two ``(x1, y1, x2, y2)`` boxes."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(width, 0.0) * max(height, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _load(path: Path) -> dict[str, Any]:
    artifact: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return artifact


def _is_current(path: Path) -> bool:
    """Whether ``path`` holds a readable artifact of this version (else it is rebuilt)."""
    if not path.is_file():
        return False
    try:
        artifact = _load(path)
    except Exception:
        return False  # truncated, corrupt or from an incompatible torch: rebuilt
    return bool(artifact.get("format") == _FORMAT and artifact.get("version") == DETECTOR_VERSION)


def main(argv: list[str] | None = None) -> None:
    """``python -m workers.demo_detector [--force] [--path PATH]``: build and report."""
    parser = argparse.ArgumentParser(prog="python -m workers.demo_detector", description=__doc__)
    parser.add_argument("--force", action="store_true", help="retrain even if it is cached")
    parser.add_argument("--path", type=Path, default=None, help="artifact path")
    args = parser.parse_args(argv)
    path = build_detector(args.path, force=args.force)
    meta = detector_metadata(path)
    print(
        f"{meta['version']}: held-out recall {meta['heldout_recall']:.1%}, precision "
        f"{meta['heldout_precision']:.1%} on {meta['heldout_scenes']} scenes at score "
        f"{meta['score_threshold']}, trained in {meta['train_seconds']:.1f} s "
        f"({meta['train_cpu_seconds']:.1f} s of CPU time) -> {path}"
    )


if __name__ == "__main__":
    main()
