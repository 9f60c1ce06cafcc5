"""Object detection, instance segmentation and keypoints: torchvision-style detectors.

``Detector`` serves any module with torchvision's detection interface: in eval mode
it takes a list of float (C, H, W) images in [0, 1], each of its own size, and
returns one dict per image with ``boxes`` (x1, y1, x2, y2 in that image's pixels),
``labels`` and ``scores``, plus ``masks`` (Mask R-CNN) or ``keypoints`` and
``keypoints_scores`` (Keypoint R-CNN). Every torchvision detector does (Faster R-CNN,
RetinaNet, FCOS, SSD, SSDlite, Mask R-CNN, Keypoint R-CNN), and so may a model of
yours.

Images reach the model at the size they were submitted (decoded on the CPU, or by
nvJPEG on the device), and the model's own transform resizes and normalizes them,
so boxes come back in the submitted image's pixels and equal what the model gives
one image at a time; ``workers.handlers.tasks.groups`` says how batches keep that true.
Results are ``schemas.outputs`` documents (``conveyor.detection.v1``,
``conveyor.instance_segmentation.v1``, ``conveyor.keypoints.v1``).

Reduced precision (``dtype`` float16 or bfloat16) runs the forward under autocast
with the weights in float32: convolutions run in half precision while box
arithmetic stays in float32, where float16 would round coordinates past 1024 to
whole pixels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from schemas import DEFAULT_LIMITS, Limits
from schemas.outputs import DETECTION_V1, INSTANCE_SEGMENTATION_V1, KEYPOINTS_V1
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.handlers.base import DeviceInput
from workers.handlers.tasks.full_size import FullSizeImageTask
from workers.handlers.tasks.groups import ShapeKey, group_indices
from workers.handlers.tasks.params import DetectionParams
from workers.handlers.tasks.rle import encode_columns

Task = Literal["detection", "instance_segmentation", "keypoints"]
OUTPUT_TYPES: dict[str, str] = {
    "detection": DETECTION_V1,
    "instance_segmentation": INSTANCE_SEGMENTATION_V1,
    "keypoints": KEYPOINTS_V1,
}
DEFAULT_SCORE_THRESHOLD = 0.5
"""Detections scoring below this are left out unless a request asks for a lower
``score_threshold`` (torchvision models keep nothing below their own
``box_score_thresh``, 0.05 by default, whatever a request asks)."""


class Detector(FullSizeImageTask):
    """A torchvision-style detection module served as a handler (see the module doc)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        labels: Sequence[str],
        task: Task = "detection",
        keypoint_names: Sequence[str] = (),
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        decode: DecodeOption = "auto",
        decode_budget: DecodeBudget | None = None,
        score_threshold: float = DEFAULT_SCORE_THRESHOLD,
        mode: Literal["RGB", "L"] = "RGB",
    ) -> None:
        """Wrap ``module`` (moved to ``device``, in eval mode).

        ``labels`` names the class indices the module returns (for torchvision's COCO
        models, ``weights.meta["categories"]``: index 0 is the background); an index
        past its end is reported as its number. ``task`` picks the result document;
        ``keypoints`` needs ``keypoint_names``. ``dtype`` other than float32 runs the
        forward under autocast. ``decode`` and ``decode_budget`` are as for ``ImageModel``.
        """
        if task not in OUTPUT_TYPES:
            raise ValueError(f"task must be one of {', '.join(OUTPUT_TYPES)}, not {task!r}")
        if task == "keypoints" and not keypoint_names:
            raise ValueError("a keypoint model needs its keypoint names")
        super().__init__(
            module,
            name=name,
            version=version,
            labels=labels,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            decode=decode,
            decode_budget=decode_budget,
            mode=mode,
        )
        self.task: Task = task
        self.keypoint_names: tuple[str, ...] = tuple(keypoint_names)
        self.score_threshold = score_threshold
        self.max_detections = _detections_per_image(self.module)
        """The most detections the module returns per image: the cap on ``max_detections``."""
        self._shape_key = ShapeKey(self.module)

    def parse_params(self, params: Mapping[str, Any]) -> DetectionParams:
        """The request's parameters; ``ContractError(bad_request)`` for a bad one."""
        return DetectionParams.parse(
            params,
            self.labels,
            default_threshold=self.score_threshold,
            max_detections=self.max_detections,
            with_masks=self.task == "instance_segmentation",
        )

    def check_params(self, params: Mapping[str, Any]) -> None:
        self.parse_params(params)

    def forward(self, batch: DeviceInput) -> list[dict[str, Any]]:
        """One dict of the module's outputs per image, plus its ``size`` (height, width)."""
        images = list(batch)
        outputs: list[dict[str, Any]] = [{} for _ in images]
        for group in group_indices([self._shape_key(image) for image in images]):
            # As torchvision's to_tensor: uint8 to float32, then / 255.
            floats = [images[i].to(torch.float32).div(255) for i in group]
            with self._precision():
                found = self.module(floats)
            for i, detections in zip(group, found, strict=True):
                outputs[i] = {**detections, "size": tuple(images[i].shape[-2:])}
        return outputs

    def postprocess(
        self, outputs: Sequence[dict[str, Any]], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        return [
            self._document(output, self.parse_params(p))
            for output, p in zip(outputs, params, strict=True)
        ]

    def _document(self, output: Mapping[str, Any], params: DetectionParams) -> dict[str, Any]:
        height, width = output["size"]
        scores: torch.Tensor = output["scores"]
        labels: torch.Tensor = output["labels"]
        keep = scores >= params.score_threshold
        if params.classes is not None:
            wanted = torch.tensor(sorted(params.classes), device=labels.device)
            keep &= torch.isin(labels, wanted)
        chosen = keep.nonzero().squeeze(1)
        order = scores[chosen].argsort(descending=True, stable=True)[: params.max_detections]
        chosen = chosen[order]
        # One device-to-host copy for the boxes, scores and labels together.
        rows = torch.cat(
            [
                output["boxes"][chosen].float(),
                scores[chosen, None].float(),
                labels[chosen, None].float(),  # exact: class indices are far below 2**24
            ],
            dim=1,
        )
        detections: list[dict[str, Any]] = []
        for *box, score, index in rows.cpu().tolist():
            label = int(index)
            name = self.labels[label] if label < len(self.labels) else str(label)
            detections.append({"box": box, "score": score, "index": label, "label": name})
        document: dict[str, Any] = {"type": OUTPUT_TYPES[self.task], "width": width}
        document["height"] = height
        if self.task == "instance_segmentation":
            masks = _masks(output["masks"][chosen], params, height, width) if params.masks else None
            for n, detection in enumerate(detections):
                detection["mask"] = None if masks is None else masks[n]
        elif self.task == "keypoints":
            document["keypoint_names"] = list(self.keypoint_names)
            points = torch.cat(
                [
                    output["keypoints"][chosen][..., :2].float(),
                    output["keypoints_scores"][chosen][..., None].float(),
                ],
                dim=2,
            )
            for detection, keypoints in zip(detections, points.cpu().tolist(), strict=True):
                detection["keypoints"] = keypoints
        document["detections"] = detections
        return document


def _masks(
    probabilities: torch.Tensor, params: DetectionParams, height: int, width: int
) -> list[dict[str, Any]]:
    """COCO RLE of each (1, H, W) mask probability map, thresholded: only the columns a
    mask touches leave the device (two copies for all of them)."""
    binary = probabilities[:, 0] > params.mask_threshold
    used = binary.any(dim=1).cpu().numpy()  # (n, W): the columns each mask touches
    spans: list[tuple[int, int]] = []
    bands: list[torch.Tensor] = []
    for n, columns in enumerate(used):
        touched = np.flatnonzero(columns)
        left, right = (int(touched[0]), int(touched[-1]) + 1) if touched.size else (0, 0)
        spans.append((left, right))
        bands.append(binary[n, :, left:right].T.reshape(-1))  # column by column
    flat = torch.cat(bands).cpu().numpy() if bands else np.zeros(0, dtype=bool)
    masks: list[dict[str, Any]] = []
    offset = 0
    for left, right in spans:
        size = (right - left) * height
        columns = flat[offset : offset + size].reshape(right - left, height)
        offset += size
        masks.append({"size": [height, width], "counts": encode_columns(columns, left, width)})
    return masks


def _detections_per_image(module: torch.nn.Module) -> int:
    """The module's own cap on detections per image (torchvision's ``detections_per_img``
    or ``box_detections_per_img``); 100, torchvision's default, when it has none."""
    for owner in (module, getattr(module, "roi_heads", None)):
        cap = getattr(owner, "detections_per_img", None)
        if isinstance(cap, int) and cap > 0:
            return cap
    return 100
