"""What the full-size image handlers share (``Detector``, ``SemanticSegmenter``).

Images reach these models at the size they were submitted, one tensor each: decoded
on the CPU under the decode budget, or kept encoded for the device's JPEG path
(``workers.decode.gpu.image_list_decoder``) and decoded there when the batch is
collated. A dtype other than float32 runs the forward under autocast, with the
weights in float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

from schemas import ContentType, Limits
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption, image_list_decoder
from workers.decode.images import decode_full

EXAMPLE_SIZE = (320, 240)  # width, height of the warm-up image


class FullSizeImageTask:
    """The module, its device and precision, and the images' way to it."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        labels: Sequence[str],
        device: torch.device | str,
        dtype: torch.dtype,
        channels_last: bool,
        limits: Limits,
        decode: DecodeOption,
        decode_budget: DecodeBudget | None,
        mode: Literal["RGB", "L"],
    ) -> None:
        if decode not in ("auto", "cpu", "gpu", "gpu-hw"):
            raise ValueError(f"decode must be auto, cpu, gpu or gpu-hw, not {decode!r}")
        self.name = name
        self.version = version
        self.labels: tuple[str, ...] = tuple(labels)
        self.device = torch.device(device)
        self.dtype = dtype
        self.mode: Literal["RGB", "L"] = mode
        self._limits = limits
        self.decode_budget = decode_budget
        """Bounds the memory of CPU decodes running at once (shared by the threads)."""
        module = module.to(self.device).eval()
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.module = module
        self.batch_decoder = image_list_decoder(decode, mode, self.device, limits)
        """The device JPEG path, or ``None`` when every image is decoded on the CPU."""

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Raise ``ContractError(bad_request)`` for parameters the task refuses."""
        raise NotImplementedError

    def example_item(self) -> torch.Tensor:
        width, height = EXAMPLE_SIZE
        if self.batch_decoder is not None:
            return self.batch_decoder.example(width, height)
        return torch.full((3 if self.mode == "RGB" else 1, height, width), 128, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        # Checked here, before the decode: a bad request costs no pixels.
        self.check_params(params)
        if self.batch_decoder is not None and content_type == ContentType.JPEG:
            encoded = self.batch_decoder.encoded(payload)
            if encoded is not None:
                return encoded
        return decode_full(
            payload,
            content_type,
            self.mode,
            max_pixels=self._limits.max_pixels,
            budget=self.decode_budget,
        )

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if self.batch_decoder is not None:
            return self.batch_decoder.collate(items, device)
        return [item.to(device, non_blocking=True) for item in items]

    def _precision(self) -> AbstractContextManager[Any]:
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)
