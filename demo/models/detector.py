"""The video demo's detector: digits on a canvas, found by a small CenterNet trained here.

The network (``demo.models.centernet``) learns from scenes drawn here
(``demo.models.scenes``), in well under a minute on one CPU thread. The worker
serves it as it serves any handler class of a user's, with the same ``Detector``
handler as torchvision's detectors:
``conveyor worker --model demo.models.detector:DigitsDetector``. The held-out
recall and precision (scenes of held-out digits, never trained on) are measured at
build time and stored with the weights; a build below ``MIN_RECALL`` or
``MIN_PRECISION`` fails instead of serving a bad model.

Build it with ``python -m demo.models.detector [--force]``; the worker builds it on
first use.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from demo.models.centernet import LABELS, STRIDE, DigitsCenterNet
from demo.models.digits import model_folder
from demo.models.scenes import Box, DigitSet, as_jpeg, random_scene
from schemas import DEFAULT_LIMITS, Limits
from workers.handlers import DecodeOption, Detector

DETECTOR_VERSION = "digits-centernet-v1"
"""Reported as ``model_version``; bump it when the architecture or training changes."""
SCORE_THRESHOLD = 0.4
"""The handler's default ``score_threshold``, and the one the held-out figures use."""
MIN_RECALL = 0.85
MIN_PRECISION = 0.90

_FORMAT = "conveyor.digits-centernet/1"
_SEED = 2019
_STEPS = 500
_BATCH = 16
_LEARNING_RATE = 6e-3
_HELDOUT_SCENES = 200
# Served frames arrive as JPEGs, often cut from a compressed video: training scenes go
# through JPEG at a random quality (blocking, ringing, halved colour resolution) too.
_JPEG_QUALITIES = (60, 95)
SERVED_JPEG_QUALITY = 85
"""The quality ``conveyor stream`` sends frames at by default; held-out scenes use it."""


class DigitsDetector(Detector):
    """The demo detector as a handler: ``--model demo.models.detector:DigitsDetector``.

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


def default_model_path() -> Path:
    """``digits-centernet-v1.pt`` in the demo models' folder (``model_folder``)."""
    return model_folder() / f"{DETECTOR_VERSION}.pt"


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
    scenes: list[list[Box]],
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
            cx, cy = (x1 + x2) / 2 / STRIDE, (y1 + y2) / 2 / STRIDE
            col, row = int(cx), int(cy)
            sigma = max(x2 - x1, y2 - y1) / STRIDE / 6 + 0.3
            peak = torch.exp(-((cols - col) ** 2 + (rows - row) ** 2) / (2 * sigma**2))
            target[n, value] = torch.maximum(target[n, value], peak)
            size_target[n, :, row, col] = torch.tensor(
                [(x2 - x1) / STRIDE, (y2 - y1) / STRIDE, cx - col, cy - row]
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
    truth: list[Box],
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
    """``python -m demo.models.detector [--force] [--path PATH]``: build and report."""
    parser = argparse.ArgumentParser(prog="python -m demo.models.detector", description=__doc__)
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
