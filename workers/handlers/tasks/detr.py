"""Set-prediction detectors of a fixed input size (RT-DETR), served batch-native.

``DetrDetector`` serves a module with the DETR-family interface of transformers
(``RTDetrForObjectDetection``): it takes a float (N, 3, H, W) batch of ``pixel_values``
at one fixed size and returns ``logits`` (N, queries, classes) and ``pred_boxes``
(N, queries, 4: centre x, centre y, width, height as fractions of the input).

- **Input.** Every image is fitted to the model's input size (``ImageSpec``, from the
  model's image processor: RT-DETR resizes each side to 640, not keeping the aspect
  ratio, as its published weights were trained), on the CPU in ``preprocess`` or, for
  JPEGs on CUDA, by nvJPEG and one batched resize in ``collate``
  (``workers.decode.gpu.BatchDecoder``). The submitted image's size travels with its
  pixels: an item is the fitted (C, H + 1, W) image whose extra row starts with the
  width and height (``SIZE_BYTES``), or, for the device path, those bytes and then the
  JPEG (1-D); ``collate`` builds the (N, C, H + 1, W) uint8 batch the forward takes.
- **Forward and post-processing in one module** (``DetrServing``: what a compiled
  forward, a CUDA graph or an Inductor package runs): normalization, the model, then
  for the whole batch at once sigmoid scores over queries × classes, the top
  ``queries`` of them, boxes from centre-size to corners, and mapped back to the
  submitted image's pixels by a per-image scale and offset. This is what
  transformers' ``post_process_object_detection`` computes (focal-loss models),
  without its per-image loop. The output is one float32 (N, 1 + queries, 6) tensor:
  row 0 the image's width and height, then ``[x1, y1, x2, y2, score, class]`` best
  first.
- **Thresholds.** ``postprocess_device`` applies each request's ``score_threshold`` as
  a mask (the score of a detection below it becomes -1), and the one host copy of the
  batch follows; ``postprocess_host`` builds the ``conveyor.detection.v1`` documents
  (``classes`` and ``max_detections`` there, from host arrays).

Reduced precision (``dtype`` float16 or bfloat16) runs the model under autocast with
float32 weights, as ``workers.handlers.tasks.detection.Detector`` does; scores and box
arithmetic stay in float32.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from PIL import Image

from schemas import DEFAULT_LIMITS, ContentType, Limits
from schemas.outputs import DETECTION_V1
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.decode.images import IMAGE_TYPES, ImageSpec, decode, read_npy
from workers.decode.jpeg import read_jpeg_header
from workers.handlers.base import ImageModel, Normalized, to_host
from workers.handlers.tasks.detection import DEFAULT_SCORE_THRESHOLD
from workers.handlers.tasks.params import DetectionParams

SIZE_BYTES = 8
"""An item's size header: width and height as little-endian uint32."""
DEFAULT_GPU_BATCH = 64
"""``max_batch_size`` on a GPU unless set: at 640x640 a batch of 64 keeps an H200 busy,
and bounds a process's activations to a few GiB (docs/models.md, "Real-time detection")."""
_DROPPED = -1.0  # the score of a detection below its request's threshold


class DetrServing(torch.nn.Module):
    """The stacked uint8 (N, C, H + 1, W) batch to the (N, 1 + queries, 6) detections
    (see the module doc): normalization, the model and the batched post-processing."""

    def __init__(
        self,
        module: torch.nn.Module,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        input_size: tuple[int, int],
        autocast: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.training = False
        self.normalized = Normalized(_Logits(module), mean, std)
        self.autocast = autocast
        # A buffer, not a tensor made in forward: no host-to-device copy while a CUDA
        # graph records it.
        self.input_size: torch.Tensor
        self.register_buffer("input_size", torch.tensor(input_size), persistent=False)
        self.place_values: torch.Tensor
        self.register_buffer("place_values", 256 ** torch.arange(4), persistent=False)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        height = batch.shape[2] - 1
        pixels, header = batch[:, :, :height], batch[:, 0, height, :SIZE_BYTES]
        # The size header's two little-endian uint32, by arithmetic (no dtype view: plain
        # ops for every compiler): (N, 2) width, height.
        digits = header.reshape(-1, 2, 4).to(torch.int64)
        sizes = (digits * self.place_values).sum(dim=2).float()
        with self._precision(batch.device):
            logits, boxes = self.normalized(pixels)
        return detections(logits.float(), boxes.float(), sizes, self.input_size.float())

    def _precision(self, device: torch.device) -> AbstractContextManager[Any]:
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


class _Logits(torch.nn.Module):
    """transformers' output object as a plain (logits, pred_boxes) pair."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.module(pixel_values=pixel_values)
        return out.logits, out.pred_boxes


def detections(
    logits: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor, input_size: torch.Tensor
) -> torch.Tensor:
    """The batched post-processing: (N, queries, classes) logits and (N, queries, 4)
    centre-size boxes (fractions of the ``input_size`` (2: width, height) the model saw) of
    images of ``sizes`` (N, 2: width, height) to (N, 1 + queries, 6) rows (module doc).

    Each image was fitted to the input by a scale per axis and an offset (zero for a
    plain resize): input pixel = image pixel × scale + offset, undone here per image.
    """
    count, queries, classes = logits.shape
    scores, index = logits.sigmoid().flatten(1).topk(queries, dim=1)  # sorted, best first
    labels = index % classes
    chosen = boxes.gather(1, (index // classes).unsqueeze(-1).expand(-1, -1, 4))
    centre, extent = chosen[..., :2], chosen[..., 2:] / 2
    fitted = input_size.to(sizes.dtype)
    scale = fitted / sizes.clamp(min=1)  # padding rows carry size 0
    offset = torch.zeros_like(scale)
    corners = torch.cat([centre - extent, centre + extent], dim=-1) * fitted.repeat(2)
    pixels = (corners - offset.repeat(1, 2)[:, None]) / scale.repeat(1, 2)[:, None]
    rows = torch.cat([pixels, scores[..., None], labels[..., None].to(scores.dtype)], dim=-1)
    head = torch.zeros((count, 1, 6), dtype=rows.dtype, device=rows.device)
    head[:, 0, :2] = sizes
    return torch.cat([head, rows], dim=1)


class DetrDetector(ImageModel):
    """A DETR-family detector of a fixed input size served as a handler (module doc)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        labels: Sequence[str],
        image: ImageSpec,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        limits: Limits = DEFAULT_LIMITS,
        decode: DecodeOption = "auto",
        decode_budget: DecodeBudget | None = None,
        score_threshold: float = DEFAULT_SCORE_THRESHOLD,
        gpu_batch: int = DEFAULT_GPU_BATCH,
    ) -> None:
        """Wrap ``module`` (moved to ``device``, float32 weights, eval mode). ``labels``
        names its classes in order; ``image`` is its input size and how images are
        fitted to it; ``mean`` and ``std`` its normalization (0 and 1 for none);
        ``dtype`` other than float32 runs it under autocast; ``gpu_batch`` is the
        ``max_batch_size`` a GPU worker takes unless told otherwise."""
        if not labels:
            raise ValueError("a detector needs at least one label")
        if image.width < SIZE_BYTES:
            raise ValueError(f"an input narrower than {SIZE_BYTES} pixels cannot carry its size")
        super().__init__(
            module,
            name=name,
            version=version,
            image=image,
            mean=mean,
            std=std,
            device=device,
            dtype=torch.float32,
            limits=limits,
            decode=decode,
            decode_budget=decode_budget,
        )
        self.dtype = dtype
        self.labels: tuple[str, ...] = tuple(labels)
        self.score_threshold = score_threshold
        self.gpu_batch = gpu_batch
        self.max_detections = int(getattr(getattr(module, "config", None), "num_queries", 100))
        """Detections per image at most: the model's queries."""
        autocast = None if dtype == torch.float32 else dtype
        size = (image.width, image.height)
        serving = DetrServing(self.module, mean, std, input_size=size, autocast=autocast)
        self.serving = serving.to(self.device, torch.float32)  # the float64 buffers too

    def parse_params(self, params: Mapping[str, Any]) -> DetectionParams:
        """The request's parameters; ``ContractError(bad_request)`` for a bad one."""
        return DetectionParams.parse(
            params,
            self.labels,
            default_threshold=self.score_threshold,
            max_detections=self.max_detections,
            with_masks=False,
        )

    def check_params(self, params: Mapping[str, Any]) -> None:
        self.parse_params(params)

    def example_item(self) -> torch.Tensor:
        width, height = self.image.width + 16, self.image.height + 16
        if self.batch_decoder is not None:
            return _headed(self.batch_decoder.example(), width, height)
        pixels = torch.full(
            (self.image.channels, self.image.height, self.image.width), 128, dtype=torch.uint8
        )
        return _with_size_row(pixels, width, height)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        self.check_params(params)
        if self.batch_decoder is not None and content_type == ContentType.JPEG:
            encoded = self.batch_decoder.encoded(payload)
            header = read_jpeg_header(payload) if encoded is not None else None
            if encoded is not None and header is not None:
                return _headed(encoded, header.width, header.height)
        pixels = decode(
            payload,
            content_type,
            self.image,
            max_pixels=self._limits.max_pixels,
            budget=self.decode_budget,
        )
        width, height = _submitted_size(payload, content_type)
        return _with_size_row(pixels, width, height)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The (N, C, H + 1, W) uint8 batch on ``device``: the fitted images (JPEGs
        decoded there in one call when the device path is on) and their size rows."""
        height = self.image.height
        headers = torch.stack([_header_of(item, height) for item in items])
        images = [item[SIZE_BYTES:] if item.ndim == 1 else item[:, :height] for item in items]
        pixels = None
        if self.batch_decoder is not None:
            pixels = self.batch_decoder.collate(images, device)
        if pixels is None:
            pixels = _upload(torch.stack(images), device)
        size_rows = pixels.new_zeros((len(items), pixels.shape[1], 1, pixels.shape[3]))
        size_rows[:, 0, 0, :SIZE_BYTES] = _upload(headers, device)
        return torch.cat([pixels, size_rows], dim=2)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self.serving(batch.to(self.device))
        return outputs

    def exportable(self) -> torch.nn.Module | None:
        """The whole forward, post-processing included, as one module."""
        return self.serving

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        device = self.postprocess_device(outputs, params)
        return self.postprocess_host(to_host(device), params)

    def postprocess_device(
        self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """Each request's ``score_threshold`` as a mask over the batch's detections: the
        score of one below it becomes -1. One tensor, so one copy to the host."""
        thresholds = _upload(
            torch.tensor([self.parse_params(p).score_threshold for p in params]), outputs.device
        )
        found = outputs[:, 1:]
        scores = found[..., 4]
        kept = torch.where(scores >= thresholds[:, None], scores, _DROPPED)
        masked = torch.cat([found[..., :4], kept[..., None], found[..., 5:]], dim=2)
        return (torch.cat([outputs[:, :1], masked], dim=1),)

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The ``conveyor.detection.v1`` documents from the host copies."""
        rows = tensors[0].numpy()
        labels = self.labels
        documents: list[Any] = []
        for n, p in enumerate(params):
            asked = self.parse_params(p)
            found = rows[n, 1:]
            keep = found[:, 4] >= 0
            if asked.classes is not None:
                keep &= np.isin(found[:, 5], sorted(asked.classes))
            chosen = found[keep][: asked.max_detections].tolist()
            width, height = int(rows[n, 0, 0]), int(rows[n, 0, 1])
            documents.append(
                {
                    "type": DETECTION_V1,
                    "width": width,
                    "height": height,
                    "detections": [
                        {"box": box, "score": score, "index": int(i), "label": labels[int(i)]}
                        for *box, score, i in chosen
                    ],
                }
            )
        return documents


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to CUDA through pinned memory, without blocking the host."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _headed(encoded: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """An encoded JPEG behind its size header (1-D uint8)."""
    return torch.cat([_size_header(width, height), encoded])


def _with_size_row(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """A fitted (C, H, W) image with its size row below: (C, H + 1, W)."""
    row = pixels.new_zeros((pixels.shape[0], 1, pixels.shape[2]))
    row[0, 0, :SIZE_BYTES] = _size_header(width, height)
    return torch.cat([pixels, row], dim=1)


def _header_of(item: torch.Tensor, height: int) -> torch.Tensor:
    """The size header of an item, either form (module doc)."""
    return item[:SIZE_BYTES] if item.ndim == 1 else item[0, height, :SIZE_BYTES]


def _size_header(width: int, height: int) -> torch.Tensor:
    raw = np.array([width, height], dtype="<u4").tobytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _submitted_size(payload: bytes, content_type: ContentType) -> tuple[int, int]:
    """(width, height) of a payload that ``decode`` has already accepted."""
    if content_type in IMAGE_TYPES:
        with Image.open(io.BytesIO(payload), formats=[IMAGE_TYPES[content_type]]) as img:
            return img.width, img.height
    height, width = read_npy(payload).shape[:2]
    return int(width), int(height)
