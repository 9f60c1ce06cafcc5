"""The demo detector's network: a CenterNet small enough to train in under a minute on a CPU.

CenterNet (Zhou et al., "Objects as Points", 2019): a stride-8 convolutional
body, a heatmap per digit class whose peaks are objects, and a box size and
sub-cell offset at each peak. ``DigitsCenterNet`` follows torchvision's
detection interface (a list of float images in, one dict of
``boxes``/``labels``/``scores`` per image out), so the worker serves it with the
same ``Detector`` handler as torchvision's detectors (``demo.models.detector``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LABELS = [str(d) for d in range(10)]
STRIDE = 8
"""Pixels per cell of the heatmaps."""
_MAX_DETECTIONS = 20


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
        size = box[:2, ys, xs].clamp(min=0) * STRIDE
        centre_x = (xs + box[2, ys, xs]) * STRIDE
        centre_y = (ys + box[3, ys, xs]) * STRIDE
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
