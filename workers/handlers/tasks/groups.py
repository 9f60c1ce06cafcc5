"""Batches of variable-size images, run as groups that the model sees exactly as alone.

Models that take images of any size cannot stack them as they come. torchvision's
detectors pad every image of a batch with zeros to the batch's largest (rounded up
to a multiple of 32); an image padded more than it would be alone gets different
features near its bottom and right edges, and so different boxes: its answer would
depend on which other requests shared its batch. Segmentation models need one shape
per batch. So a handler keys each image by the shape the model will give it
(``ShapeKey``), runs one forward per group of equal keys (``group_indices``), and
every image is padded exactly as it would be alone.

What remains is the floating-point summation order of batched kernels, which is not
the same at every batch size: a few units in the last place of fp32 (docs/models.md
states the tolerances this gives).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from functools import lru_cache

import torch

_CACHED_SHAPES = 4096  # distinct image sizes remembered per model; frames of a camera share one


def group_indices(keys: Sequence[Hashable]) -> list[list[int]]:
    """Item indices grouped by key, each group in item order, groups in order of first
    appearance: ``[a, b, a, c] -> [[0, 2], [1], [3]]``."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values())


class ShapeKey:
    """The padded input shape a torchvision detector gives an image of a given size.

    It asks the model's own ``GeneralizedRCNNTransform`` (resize, then round up to
    ``size_divisible``) on a tensor of the "meta" device, which has a shape but no data,
    so the answer is the transform's own arithmetic at no cost. Models without that
    transform are keyed by the image's exact shape, which is always safe.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        from torchvision.models.detection.transform import GeneralizedRCNNTransform

        transform = getattr(module, "transform", None)
        self._transform = transform if isinstance(transform, GeneralizedRCNNTransform) else None
        self._padded = lru_cache(maxsize=_CACHED_SHAPES)(self._padded_shape)

    def __call__(self, image: torch.Tensor) -> tuple[int, ...]:
        """The key of one (C, H, W) image."""
        if self._transform is None:
            return tuple(image.shape)
        return self._padded(tuple(image.shape))

    def _padded_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        assert self._transform is not None
        if self._transform.training:
            raise RuntimeError("the model is in training mode: its resize is random")
        resized, _ = self._transform.resize(torch.empty(shape, device="meta"), None)
        stride = self._transform.size_divisible
        height, width = resized.shape[-2:]
        return (
            shape[0],
            math.ceil(height / stride) * stride,
            math.ceil(width / stride) * stride,
        )
