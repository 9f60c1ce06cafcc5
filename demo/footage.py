"""The video demo's footage: digits bouncing on a canvas with known boxes, and the
served boxes drawn back onto its frames.

``make_video`` draws held-out digits (never trained on) with the detector's own
scene drawing (``demo.models.scenes``), so every frame's true boxes are known;
``annotate`` draws what the pipeline answered onto the decoded frames, for people
to look at: each box with the detector's label and score, and beside them the
second model's label and score for that box's crop (``reading``), in cyan when the
two labels agree and in red when they differ or the box has no ``ok`` reading.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from demo.models.scenes import CANVAS, Box, DigitSet, Placement, draw_scene
from demo.worker import DemoError
from schemas import Result, Status

FPS = 10
DIGIT_SECONDS = 2  # each track shows a new digit this often
SCALE = 3  # the annotated output is drawn at 3x the video's size
_LANES = 4  # one digit per quarter of the canvas, so digits never overlap
_QUALITY_CRF = "16"  # H.264 quality: high enough that the frames stay the model's kind
_BOX_COLOUR = (255, 210, 0)  # the detector's box, label and score
_READ_COLOUR = (0, 210, 255)  # the second model's label and score, agreeing with the detector's
_ODD_COLOUR = (255, 90, 90)  # ... differing from it, or no ok reading ("?")
_TAG_GAP = 5  # pixels between the two tags above a box
Truth = list[Box]


@dataclass
class _Track:
    """One digit bouncing around its quarter of the canvas."""

    digit: int  # row of the digit set
    size: int  # side, pixels
    origin: tuple[int, int]  # top-left corner of its quarter
    position: np.ndarray[Any, np.dtype[np.float64]]  # x, y within the quarter
    velocity: np.ndarray[Any, np.dtype[np.float64]]  # pixels per frame
    colour: tuple[float, float, float]

    def step(self, room: tuple[int, int]) -> Placement:
        """Move one frame on, reflecting off the quarter's edges; where it is now."""
        limit = np.array(room, dtype=float) - self.size
        self.position = self.position + self.velocity
        for axis in (0, 1):
            if not 0 <= self.position[axis] <= limit[axis]:
                self.velocity[axis] *= -1
                self.position[axis] = min(max(self.position[axis], 0.0), limit[axis])
        x, y = (self.origin[axis] + int(self.position[axis]) for axis in (0, 1))
        return Placement(self.digit, x, y, self.size, self.colour)


def make_video(path: Path, frames: int, seed: int = 7) -> list[Truth]:
    """Write ``frames`` frames of bouncing held-out digits to ``path`` (H.264 MP4 at
    ``FPS``); returns each frame's true boxes."""
    import av

    rng = np.random.default_rng(seed)
    digits = DigitSet.load(heldout=True)
    width, height = CANVAS
    room = (width // 2, height // 2)
    tracks = []
    for lane in range(_LANES):
        size = int(rng.integers(22, 37))
        red, green, blue = (float(c) for c in rng.uniform(0.6, 1.0, 3))
        tracks.append(
            _Track(
                digit=int(rng.integers(len(digits.values))),
                size=size,
                origin=((lane % 2) * room[0], (lane // 2) * room[1]),
                position=rng.uniform(0, [room[0] - size, room[1] - size]),
                velocity=rng.uniform(1.0, 2.5, 2) * rng.choice([-1, 1], 2),
                colour=(red, green, blue),
            )
        )
    red, green, blue = (float(c) for c in rng.uniform(0.0, 0.2, 3))
    truths: list[Truth] = []
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"crf": _QUALITY_CRF})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for n in range(frames):
            if n and n % (DIGIT_SECONDS * FPS) == 0:
                for track in tracks:
                    track.digit = int(rng.integers(len(digits.values)))
            placements = [track.step(room) for track in tracks]
            canvas, truth = draw_scene(digits, placements, (red, green, blue), rng)
            truths.append(truth)
            pixels = (canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = n
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return truths


def annotate(video: Path, results: Sequence[Result | None], gif: Path, png: Path) -> None:
    """Draw each frame's boxes, the detector's labels and the second model's readings on
    the video's frames, at ``SCALE`` times their size: every frame into an animated GIF,
    the middle one into a PNG."""
    import av

    font = ImageFont.load_default(size=14)
    drawn: list[Image.Image] = []
    with av.open(str(video)) as container:
        for frame, result in zip(container.decode(video=0), results, strict=False):
            image = frame.to_image()  # type: ignore[no-untyped-call]
            image = image.resize(
                (image.width * SCALE, image.height * SCALE), Image.Resampling.NEAREST
            )
            draw = ImageDraw.Draw(image)
            for detection in detections(result):
                _draw_detection(draw, detection, font, image.width)
            drawn.append(image)
    if not drawn:
        raise DemoError(f"{video} has no frames to annotate")
    drawn[0].save(
        gif, save_all=True, append_images=drawn[1:], duration=1000 // FPS, loop=0, optimize=True
    )
    drawn[len(drawn) // 2].save(png)


def _draw_detection(
    draw: ImageDraw.ImageDraw,
    detection: Mapping[str, Any],
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont,
    width: int,
) -> None:
    """One box, and above it two tags: the detector's label and score, then the second
    model's (moved left where they would run past the frame's right edge)."""
    x1, y1, x2, y2 = (v * SCALE for v in detection["box"])
    draw.rectangle((x1, y1, x2, y2), outline=_BOX_COLOUR, width=2)
    tags = [(f"{detection['label']} {detection['score']:.2f}", _BOX_COLOUR)]
    read = reading(detection)
    if read is None:
        tags.append(("?", _ODD_COLOUR))
    else:
        agrees = read["label"] == detection["label"]
        tags.append(
            (f"{read['label']} {read['score']:.2f}", _READ_COLOUR if agrees else _ODD_COLOUR)
        )
    advances = [draw.textlength(text, font=font) + _TAG_GAP for text, _ in tags]
    x, y = max(min(x1, width - sum(advances)), 0), max(y1 - 17, 0)
    for (text, colour), advance in zip(tags, advances, strict=True):
        draw.rectangle(draw.textbbox((x, y), text, font=font), fill=colour)
        draw.text((x, y), text, fill=(0, 0, 0), font=font)
        x += advance


def detections(result: Result | None) -> list[dict[str, Any]]:
    """The boxes of a frame's result; none for a missing or failed one."""
    if result is None or result.status is not Status.ok:
        return []
    found: list[dict[str, Any]] = result.outputs["detections"]
    return found


def reading(detection: Mapping[str, Any]) -> dict[str, Any] | None:
    """The second model's best answer for a detection's crop (``{label, index, score}``,
    from its ``next``); None when the box got no answer, or one that is not ``ok``."""
    then = detection.get("next")
    if not isinstance(then, dict) or then.get("status") != Status.ok.value:
        return None
    answers = then.get("outputs")
    if not isinstance(answers, list) or not answers:
        return None
    best: dict[str, Any] = answers[0]
    return best
