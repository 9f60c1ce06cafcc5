"""Batched JPEG decoding on the model's device: nvJPEG, then one resize per source size.

A CPU core decodes and resizes about 200 photos (640x480) a second, so feeding a
GPU that classifies 15,000 a second from Pillow takes a machine's worth of cores;
nvJPEG decodes a whole batch in one call at GPU speed (measured in docs/benchmarks.md).
The split of work:

- ``BatchDecoder.encoded`` runs in the decode thread pool. It reads only the JPEG
  header (``read_jpeg_header``), enforces ``max_pixels`` on the declared size, and
  returns the payload bytes as a 1-D uint8 tensor. Anything it will not take (not a
  JPEG, arithmetic-coded, CMYK, 12-bit, a header it cannot parse) returns ``None``,
  and the caller decodes that item on the CPU as before.
- ``BatchDecoder.collate`` runs where the batch is built: it decodes every encoded
  item of a batch in one ``decode_jpegs`` call on the device, center-crops and
  resizes each group of same-sized images with one pair of batched matrix products
  (Pillow's filter weights; frames of one video share a size, so a video batch is
  one group), and returns the uint8 (N, C, H, W) batch on the device, in item order.
  Items already decoded on the CPU (3-D tensors) are copied in at their place. A
  JPEG the device decoder rejects is decoded again with Pillow, which either
  succeeds or raises ``decode_failed``.

The output is uint8 like the CPU path's, so the handler's normalization (and a
compiled forward) sees the same input whichever path decoded it: within one grey
level of Pillow's where both decoders agree (nvJPEG's IDCT differs by a level or
two). Where the CPU path shrinks by 2x or more it decodes at reduced DCT scale
(``draft``) and Pillow pre-reduces by whole factors; the device path resamples the
full image, so large photos differ by a few levels more.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import torch
from PIL import Image
from torch.utils.dlpack import from_dlpack

from schemas import ContentType
from workers.preprocess import ImageSpec, check_pixels, crop_box, decode_image

DecodeOption = Literal["auto", "cpu", "gpu", "gpu-hw"]
"""Where images are decoded: ``cpu`` (Pillow, in the decode threads), ``gpu`` (nvJPEG on
the model's device, in batches, through torchvision), ``gpu-hw`` (the GPU's hardware
JPEG engine through nvImageCodec, CUDA nvJPEG where the engine declines an image;
needs the ``nvidia-nvimgcodec-cu13`` package), or ``auto`` (``gpu`` on CUDA)."""

JpegBackend = Literal["nvjpeg", "nvimgcodec"]

READ_MODES = {"RGB": 3, "L": 1}
"""``torchvision.io.ImageReadMode`` values by Pillow mode, for ``decode_jpegs``."""

# Frame types nvJPEG decodes: baseline, extended sequential and progressive Huffman.
# Lossless and arithmetic-coded JPEGs (rare) take the CPU path.
_NVJPEG_SOF = frozenset({0xC0, 0xC1, 0xC2})
# Every start-of-frame marker: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_ALL_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers with no length field: TEM, RST0-7 (SOI is consumed before the loop).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
_FLOATS_PER_CHUNK = 1 << 28
_FILTERS: dict[Image.Resampling, Literal["bilinear", "bicubic"]] = {
    Image.Resampling.BILINEAR: "bilinear",
    Image.Resampling.BICUBIC: "bicubic",
}


@dataclass(frozen=True, slots=True)
class JpegHeader:
    """What a JPEG's start-of-frame segment declares."""

    width: int
    height: int
    components: int  # 1 grayscale, 3 YCbCr, 4 CMYK/YCCK
    precision: int  # bits per sample: 8, or 12 in rare medical/extended files
    marker: int  # the SOF marker byte: 0xC0 baseline, 0xC2 progressive, ...

    @property
    def device_decodable(self) -> bool:
        """Whether nvJPEG decodes it to the same colours Pillow would."""
        return self.marker in _NVJPEG_SOF and self.precision == 8 and self.components in (1, 3)


def read_jpeg_header(data: bytes) -> JpegHeader | None:
    """Parse the markers up to the first start-of-frame; ``None`` if ``data`` is not
    a JPEG this parser understands (the CPU decoder then gives the precise error).

    Reads only the header bytes, never entropy-coded data, so it costs microseconds
    and bounds memory before any decoder sees the payload.
    """
    if data[:2] != b"\xff\xd8":
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan data before any frame
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2 or pos + 2 + length > end:
            return None
        if marker in _ALL_SOF:
            if length < 8:
                return None
            precision = data[pos + 4]
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            if width == 0 or height == 0:  # height 0: defined later by a DNL marker
                return None
            return JpegHeader(width, height, data[pos + 9], precision, marker)
        pos += 2 + length
    return None


def device_decode_supported(spec: ImageSpec) -> str | None:
    """Why ``spec`` cannot use the batched device path, or ``None`` if it can."""
    if spec.resample not in _FILTERS:
        names = ", ".join(r.name for r in _FILTERS)
        return f"resampling {spec.resample.name} has no batched GPU equivalent (only {names})"
    if not _image_ops():
        return "torchvision is not installed, or this build has no JPEG decoding operators"
    return None


class BatchDecoder:
    """Decodes a batch's JPEGs on a device and fits them to ``spec`` (see the module doc).

    Thread-safety: ``encoded`` holds no state; ``collate`` is called by one thread at a time.
    """

    def __init__(
        self, spec: ImageSpec, *, max_pixels: int, backend: JpegBackend = "nvjpeg"
    ) -> None:
        """Raises ``ValueError`` when ``spec`` cannot be served this way
        (``device_decode_supported`` says why), or nvImageCodec is missing for it."""
        reason = device_decode_supported(spec)
        if reason is not None:
            raise ValueError(f"decode='gpu' is not available: {reason}; use decode='cpu'")
        self.spec = spec
        self._max_pixels = max_pixels
        self._hardware = _HardwareJpeg(spec.mode) if backend == "nvimgcodec" else None
        self._mode = READ_MODES[spec.mode]
        self._filter = _FILTERS[spec.resample]
        self._matrices: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def encoded(self, payload: bytes) -> torch.Tensor | None:
        """The payload as a 1-D uint8 tensor for ``collate``, or ``None`` when it must be
        decoded on the CPU. Raises ``ContractError(image_too_large)`` from the header alone."""
        header = read_jpeg_header(payload)
        if header is None or not header.device_decodable:
            return None
        check_pixels(header.width, header.height, self._max_pixels)
        # One copy: the record value is immutable bytes, and torch warns on wrapping
        # read-only memory. A memcpy of ~150 KB is microseconds, far below a decode.
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def example(self) -> torch.Tensor:
        """An encoded JPEG larger than the target, so warm-up runs decode and resize."""
        spec = self.spec
        size = (round(spec.width / spec.crop_ratio) + 16, round(spec.height / spec.crop_ratio) + 16)
        buffer = io.BytesIO()
        Image.new(spec.mode, size, 128).save(buffer, format="JPEG", quality=90)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """The uint8 (N, C, H, W) batch on ``device`` in item order, or ``None`` when no item
        is encoded (the caller then stacks the decoded items as usual).

        Raises ``ContractError(decode_failed)`` for a JPEG that neither nvJPEG nor Pillow
        can decode, and lets ``torch.cuda.OutOfMemoryError`` through for the caller to split.
        """
        encoded = [n for n, item in enumerate(items) if item.ndim == 1]
        if not encoded:
            return None
        spec = self.spec
        pixels = self._decode([items[n] for n in encoded], device)
        whole = self._fit_whole(pixels, len(items))
        if whole is not None:
            return whole
        out = torch.empty(
            (len(items), spec.channels, spec.height, spec.width), dtype=torch.uint8, device=device
        )
        on_host = [(n, item) for n, item in enumerate(items) if item.ndim != 1]
        by_size: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for n, image in zip(encoded, pixels, strict=True):
            if image is None:
                payload = items[n].numpy().tobytes()
                on_host.append(
                    (n, decode_image(payload, ContentType.JPEG, spec, max_pixels=self._max_pixels))
                )
            else:
                by_size[(image.shape[1], image.shape[2])].append((n, image))
        for (height, width), group in by_size.items():
            # Resampling works in float32: bound that copy (~1 GB) for large photos.
            step = max(1, _FLOATS_PER_CHUNK // (spec.channels * height * width))
            for start in range(0, len(group), step):
                part = group[start : start + step]
                fitted = self._fit(torch.stack([image for _, image in part]), width, height)
                out.index_copy_(0, _indices(part, device), fitted)
        if on_host:
            host = torch.stack([item for _, item in on_host])
            out.index_copy_(0, _indices(on_host, device), host.to(device))
        return out

    def _decode(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """Decoded (C, H, W) images on ``device``; ``None`` where the decoder refused one."""
        if self._hardware is not None and device.type == "cuda":
            return self._hardware.decode(data, device)
        try:
            return list(decode_jpegs(data, self._mode, device))
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:
            pass
        # The batched call fails as a whole, without saying which image: find them.
        decoded: list[torch.Tensor | None] = []
        for one in data:
            try:
                decoded.append(decode_jpegs([one], self._mode, device)[0])
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError:
                decoded.append(None)
        return decoded

    def _fit_whole(self, pixels: list[torch.Tensor | None], count: int) -> torch.Tensor | None:
        """The common case in one piece: every item a JPEG the device decoded, all of one
        size (frames of a camera, a corpus of one source), few enough to resample at
        once; then no index bookkeeping (and no blocking index upload) is needed."""
        if len(pixels) != count or not pixels:
            return None
        first = pixels[0]
        if first is None:
            return None
        shape = first.shape
        if any(image is None or image.shape != shape for image in pixels):
            return None
        height, width = int(shape[1]), int(shape[2])
        if count * self.spec.channels * height * width > _FLOATS_PER_CHUNK:
            return None
        return self._fit(torch.stack(pixels), width, height)  # type: ignore[arg-type]

    def _fit(self, batch: torch.Tensor, width: int, height: int) -> torch.Tensor:
        """Center-crop and resize a uint8 (N, C, height, width) batch to the target size.

        Pillow's resampling as two matrix products: each output pixel is a fixed weighted
        sum of a row (then a column) of source pixels, so one matrix per axis and source
        size does the crop and the resize for the whole group in two batched matmuls.
        This keeps Pillow's fractional crop box and its filter widening on downscale,
        which ``interpolate`` (whole-image mapping only) cannot.
        """
        spec = self.spec
        left, top, right, bottom = crop_box(width, height, spec)
        if (width, height) == (spec.width, spec.height) and (left, top) == (0.0, 0.0):
            return batch
        rows, cols = self._weights(batch.device, width, height, (left, top, right, bottom))
        # Columns first: the product with the wider source axis then runs on fewer rows.
        resized = rows @ (batch.float() @ cols.T)
        return resized.round_().clamp_(0, 255).to(torch.uint8)

    def _weights(
        self,
        device: torch.device,
        width: int,
        height: int,
        box: tuple[float, float, float, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target height, height) and (target width, width) resampling matrices, cached
        per source size: frames of a stream, or a corpus of one camera, share them."""
        key = (device, width, height)
        if key not in self._matrices:
            left, top, right, bottom = box
            kind = self._filter
            self._matrices[key] = (
                _resample_matrix(height, top, bottom, self.spec.height, kind).to(device),
                _resample_matrix(width, left, right, self.spec.width, kind).to(device),
            )
        return self._matrices[key]


def _resample_matrix(
    size: int, start: float, end: float, out: int, kind: Literal["bilinear", "bicubic"]
) -> torch.Tensor:
    """Pillow's resampling weights along one axis (``ImagingResample``'s coefficients):
    output pixel ``i`` is centred at ``start + (i + 0.5) * scale`` in the source, and the
    filter is widened by ``scale`` when shrinking, so it averages instead of skipping."""
    scale = (end - start) / out
    widen = max(scale, 1.0)
    support = (1.0 if kind == "bilinear" else 2.0) * widen
    weights = torch.zeros((out, size), dtype=torch.float64)
    for i in range(out):
        center = start + (i + 0.5) * scale
        first = max(int(center - support + 0.5), 0)
        last = min(int(center + support + 0.5), size)
        taps = torch.arange(first, last, dtype=torch.float64)
        row = _filter((taps - center + 0.5) / widen, kind)
        weights[i, first:last] = row / row.sum()
    return weights.float()


def _filter(x: torch.Tensor, kind: Literal["bilinear", "bicubic"]) -> torch.Tensor:
    x = x.abs()
    if kind == "bilinear":
        return (1.0 - x).clamp(min=0.0)
    a = -0.5  # Pillow's bicubic
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def decode_jpegs(data: list[torch.Tensor], mode: int, device: torch.device) -> list[torch.Tensor]:
    """Decode encoded JPEGs (1-D uint8 CPU tensors) to (C, H, W) uint8 images on ``device``:
    one batched nvJPEG call on CUDA. ``mode`` is a ``READ_MODES`` value. Raises
    ``RuntimeError`` if any image fails, without saying which.

    These are torchvision's JPEG decoders, called as operators.

    ``torchvision.io.decode_jpeg`` does exactly this, but since torchvision 0.29 it also
    emits a DeprecationWarning on every call (pointing at TorchCodec, which has no
    batched nvJPEG decode yet); the operators themselves are unchanged since 0.19.
    """
    if not _image_ops():
        raise RuntimeError("torchvision's JPEG decoding operators are not available")
    if device.type == "cuda":
        # The decoder allocates its outputs on the current stream but writes them from
        # a private one that does not wait for this stream (pytorch/vision#9606): memory
        # this stream freed while its kernels still read it could be overwritten. Let
        # the current stream's work (the previous batch's resize) finish first.
        torch.cuda.current_stream(device).synchronize()
        decoded: list[torch.Tensor] = torch.ops.image.decode_jpegs_cuda(data, mode, device)
        return decoded
    return [torch.ops.image.decode_jpeg(one, mode, False) for one in data]


@cache
def _image_ops() -> bool:
    """Whether torchvision's image operators are registered with ``torch.ops``.

    Importing ``torchvision.io`` registers them; it happens here, not at the top, so
    that only the device decode path pays for the import.
    """
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.image, "decode_jpeg")


def _indices(members: Sequence[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Item positions on ``device``, uploaded without blocking the host (pinned memory)."""
    positions = torch.tensor([n for n, _ in members], dtype=torch.long)
    if device.type != "cuda":
        return positions
    return positions.pin_memory().to(device, non_blocking=True)


class _HardwareJpeg:
    """The GPU's hardware JPEG engine through nvImageCodec, CUDA nvJPEG behind it for the
    images the engine declines (progressive ones, say). Images come back in device
    memory owned by nvImageCodec and are taken over through DLPack on the current
    stream, so later work on it is ordered after the decode."""

    def __init__(self, mode: str) -> None:
        try:
            from nvidia import nvimgcodec
        except ImportError as exc:
            raise ValueError(
                "decode='gpu-hw' needs nvImageCodec: pip install nvidia-nvimgcodec-cu13"
            ) from exc
        self._nvimgcodec = nvimgcodec
        self._decoders: dict[int, Any] = {}
        color = nvimgcodec.ColorSpec.SRGB if mode == "RGB" else nvimgcodec.ColorSpec.GRAY
        self._params = nvimgcodec.DecodeParams(color_spec=color, allow_any_depth=False)

    def decode(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        nvimgcodec = self._nvimgcodec
        index = device.index or 0
        decoder = self._decoders.get(index)
        if decoder is None:
            backends = [
                nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY),
            ]
            decoder = self._decoders[index] = nvimgcodec.Decoder(device_id=index, backends=backends)
        stream = torch.cuda.current_stream(device)
        sources = [nvimgcodec.CodeStream(one.numpy()) for one in data]
        images = decoder.decode(sources, params=self._params, cuda_stream=stream.cuda_stream)
        return [None if image is None else from_dlpack(image).permute(2, 0, 1) for image in images]
