"""Batched JPEG decoding on the model's device: nvJPEG, then one resize per source size.

A CPU core decodes and resizes about 200 photos (640x480) a second, so feeding a
GPU that classifies 15,000 a second from Pillow takes a machine's worth of cores;
nvJPEG decodes a whole batch in one call at GPU speed (measured in docs/benchmarks.md).
The split of work:

- ``BatchDecoder.encoded`` runs in the decode thread pool. It reads only the JPEG
  header (``jpeg.read_jpeg_header``), enforces ``max_pixels`` on the declared size, and
  returns the payload bytes as a 1-D uint8 tensor. Anything it will not take (not a
  JPEG, arithmetic-coded, CMYK, 12-bit, a header it cannot parse) returns ``None``,
  and the caller decodes that item on the CPU as before.
- ``BatchDecoder.collate`` runs where the batch is built: it decodes every encoded
  item of a batch in one ``workers.decode.jpeg.decode_jpegs`` call on the device, center-crops and
  resizes each group of same-sized images with one pair of batched matrix products
  (Pillow's filter weights; frames of one video share a size, so a video batch is
  one group), and returns the uint8 (N, C, H, W) batch on the device, in item order.
  Items already decoded on the CPU (3-D tensors) are copied in at their place. A
  JPEG the device decoder rejects is decoded again with Pillow, which either
  succeeds or raises ``decode_failed``.

The output is uint8 like the CPU path's, so the handler's normalization (and a
compiled forward) sees the same input whichever path decoded it: within one grey
level of Pillow's where both decoders agree (nvJPEG's IDCT differs by a level or
two). Both fits of ``ImageSpec`` are done this way (``reference``: the resize
matrices of the whole image, cut to the centre crop's rows and columns). Where the
``fast`` CPU path shrinks by 2x or more it decodes at reduced DCT scale (``draft``)
and Pillow pre-reduces by whole factors; the device path resamples the full image,
so large photos differ by a few levels more.

``.npy`` payloads (uint8 (H, W) or (H, W, 3) pixels: a pipeline's crops) take the same
fit: ``BatchDecoder.raw`` (decode threads) checks the header, dtype, shape and size on
the CPU with the CPU path's checks (``workers.decode.images.npy_pixels``: no pickle, the
declared size must be the bytes present) and returns the pixels as a (1, H, W, C)
tensor; ``collate`` copies a batch's pixels into one pinned buffer, uploads it in one
copy and fits them with the JPEGs' matrices. Pillow resamples them on the CPU path in
about 2 ms a 300x250 crop on one core (its resize is most of that); here the CPU only
copies the bytes. The fitted pixels are within one grey level of the CPU path's (both
apply Pillow's weights; Pillow's ``reducing_gap`` shortcut, taken from 6x downscale,
adds a few levels more for crops that much larger than the target).

Models that resize inside (detection, segmentation) take ``ImageListDecoder``: the
same batched nvJPEG decode, each image kept at its own size, handed on as a list.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

import torch
from PIL import Image

from schemas import ContentType, Limits
from workers.decode.images import (
    ImageSpec,
    crop_box,
    decode_full,
    decode_image,
    npy_pixels,
    reference_crop,
)
from workers.decode.jpeg import (
    READ_MODES,
    HardwareJpeg,
    JpegBackend,
    decode_each,
    encoded_jpeg,
    image_ops_available,
)

DecodeOption = Literal["auto", "cpu", "gpu", "gpu-hw"]
"""Where images are decoded: ``cpu`` (Pillow, in the decode threads), ``gpu`` (nvJPEG on
the model's device, in batches, through torchvision), ``gpu-hw`` (the GPU's hardware
JPEG engine through nvImageCodec, CUDA nvJPEG where the engine declines an image;
needs the ``nvidia-nvimgcodec-cu13`` package), or ``auto`` (``gpu`` on CUDA)."""

_FLOATS_PER_CHUNK = 1 << 28
_RAW = 4  # a raw item's dimensions, (1, H, W, C): never an encoded (1) or a fitted (3) item
_FILTERS: dict[Image.Resampling, Literal["bilinear", "bicubic"]] = {
    Image.Resampling.BILINEAR: "bilinear",
    Image.Resampling.BICUBIC: "bicubic",
}


def device_decode_supported(spec: ImageSpec) -> str | None:
    """Why ``spec`` cannot use the batched device path, or ``None`` if it can."""
    if spec.resample not in _FILTERS:
        names = ", ".join(r.name for r in _FILTERS)
        return f"resampling {spec.resample.name} has no batched GPU equivalent (only {names})"
    if not image_ops_available():
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
        self._hardware = HardwareJpeg(spec.mode) if backend == "nvimgcodec" else None
        self._mode = READ_MODES[spec.mode]
        self._filter = _FILTERS[spec.resample]
        self._matrices: dict[
            tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor] | None
        ] = {}

    def encoded(self, payload: bytes) -> torch.Tensor | None:
        """The payload as a 1-D uint8 tensor for ``collate``, or ``None`` when it must be
        decoded on the CPU. Raises ``ContractError(image_too_large)`` from the header alone."""
        return encoded_jpeg(payload, self._max_pixels)

    def raw(self, payload: bytes) -> torch.Tensor | None:
        """A ``.npy`` payload's pixels as a (1, H, W, C) uint8 tensor for ``collate`` to
        upload and fit, or ``None`` for the CPU path (RGB pixels for a grayscale model:
        Pillow's luma conversion; a Fortran-ordered array; with the ``fast`` fit, pixels
        already of the model's input size, which it takes as they are, a copy). Raises
        ``ContractError`` (``decode_failed``, ``image_too_large``) as the CPU path does,
        from the header alone."""
        pixels = npy_pixels(payload, self._max_pixels)
        channels = 1 if pixels.ndim == 2 else 3
        if channels > self.spec.channels or not pixels.flags.c_contiguous:
            return None
        height, width = pixels.shape[:2]
        spec = self.spec
        if spec.fit == "fast" and (height, width, channels) == (
            spec.height,
            spec.width,
            spec.channels,
        ):
            return None  # already the model's input: taken as it is, uncropped (decode_npy)
        # One copy: the record value is immutable bytes, which torch will not wrap.
        return torch.from_numpy(pixels.reshape(1, height, width, channels).copy())

    def example(self) -> torch.Tensor:
        """An encoded JPEG larger than the target, so warm-up runs decode and resize."""
        spec = self.spec
        size = (round(spec.width / spec.crop_ratio) + 16, round(spec.height / spec.crop_ratio) + 16)
        buffer = io.BytesIO()
        Image.new(spec.mode, size, 128).save(buffer, format="JPEG", quality=90)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """The uint8 (N, C, H, W) batch on ``device`` in item order, or ``None`` when no item
        is encoded or raw (the caller then stacks the decoded items as usual).

        Raises ``ContractError(decode_failed)`` for a JPEG that neither nvJPEG nor Pillow
        can decode, and lets ``torch.cuda.OutOfMemoryError`` through for the caller to split.
        """
        encoded = [n for n, item in enumerate(items) if item.ndim == 1]
        raw = [n for n, item in enumerate(items) if item.ndim == _RAW]
        if not encoded and not raw:
            return None
        data = [items[n] for n in encoded]
        if raw:
            uploaded = self._upload([items[n] for n in raw], device)
            on_device = [*decode_each(data, self._mode, device), *uploaded]
            return self._assemble(items, encoded + raw, on_device, device)
        if self._hardware is None or device.type != "cuda" or not self._hardware.takes(len(data)):
            return self._assemble(items, encoded, decode_each(data, self._mode, device), device)
        with self._hardware.decode_batch(data, device) as pixels:
            if not isinstance(pixels, torch.Tensor):
                return self._assemble(items, encoded, pixels, device)
            if len(pixels) != len(items) or pixels.numel() > _FLOATS_PER_CHUNK:
                return self._assemble(items, encoded, list(pixels), device)
            fitted = self._fit(pixels, pixels.shape[3], pixels.shape[2])
            # Already the target size: the buffer itself, which the next batch overwrites.
            shared = fitted.untyped_storage().data_ptr() == pixels.untyped_storage().data_ptr()
            return fitted.clone(memory_format=torch.contiguous_format) if shared else fitted

    def _assemble(
        self,
        items: Sequence[torch.Tensor],
        placed: list[int],
        pixels: list[torch.Tensor | None],
        device: torch.device,
    ) -> torch.Tensor:
        """The batch from the images on the device (``pixels[i]`` for ``items[placed[i]]``;
        ``None`` where the device refused a JPEG: Pillow decides) and the items decoded on
        the CPU, in item order."""
        spec = self.spec
        whole = self._fit_whole(pixels, len(items))
        if whole is not None:
            return whole
        out = torch.empty(
            (len(items), spec.channels, spec.height, spec.width), dtype=torch.uint8, device=device
        )
        on_device = set(placed)
        on_host = [(n, item) for n, item in enumerate(items) if n not in on_device]
        by_size: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for n, image in zip(placed, pixels, strict=True):
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

    def _upload(self, items: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Raw (1, H, W, C) items as (C, H, W) images on ``device`` (grayscale spread to
        RGB where the model takes RGB, as Pillow's ``convert`` does): views of one buffer,
        gathered into pinned memory and uploaded in one copy that does not block the host
        (the caching host allocator keeps the buffer until the copy is done)."""
        sizes = [item.numel() for item in items]
        pinned = device.type == "cuda"
        host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned)
        torch.cat([item.reshape(-1) for item in items], out=host)
        flat = host.to(device, non_blocking=True) if pinned else host
        images = []
        for item, chunk in zip(items, torch.split(flat, sizes), strict=True):
            _, height, width, channels = item.shape
            image = chunk.view(height, width, channels).permute(2, 0, 1)
            if channels < self.spec.channels:
                image = image.expand(self.spec.channels, height, width)
            images.append(image)
        return images

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
        weights = self._weights(batch.device, width, height)
        if weights is None:
            return batch
        rows, cols = weights
        # Columns first: the product with the wider source axis then runs on fewer rows.
        # Contiguous first: the hardware engine's images come as (N, H, W, C) permuted.
        resized = rows @ (batch.contiguous().float() @ cols.T)
        return resized.round_().clamp_(0, 255).to(torch.uint8)

    def _weights(
        self, device: torch.device, width: int, height: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(target height, height) and (target width, width) resampling matrices, cached
        per source size (frames of a stream, or a corpus of one camera, share them);
        ``None`` when the image is already what the fit makes of it."""
        key = (device, width, height)
        if key not in self._matrices:
            self._matrices[key] = self._build_weights(width, height, device)
        return self._matrices[key]

    def _build_weights(
        self, width: int, height: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        spec, kind = self.spec, self._filter
        if spec.fit == "reference":
            new_width, new_height = spec.reference_resize(width, height)
            left, top = (
                reference_crop(new_width, spec.width, floor=spec.floor_crop),
                reference_crop(new_height, spec.height, floor=spec.floor_crop),
            )
            if (new_width, new_height, left, top) == (width, height, 0, 0) and (width, height) == (
                spec.width,
                spec.height,
            ):
                return None
            rows = _cut(_resample_matrix(height, 0.0, height, new_height, kind), top, spec.height)
            cols = _cut(_resample_matrix(width, 0.0, width, new_width, kind), left, spec.width)
        else:
            left_f, top_f, right_f, bottom_f = crop_box(width, height, spec)
            if (width, height) == (spec.width, spec.height) and (left_f, top_f) == (0.0, 0.0):
                return None
            rows = _resample_matrix(height, top_f, bottom_f, spec.height, kind)
            cols = _resample_matrix(width, left_f, right_f, spec.width, kind)
        return rows.to(device), cols.to(device)


class ImageListDecoder:
    """Decodes a batch's JPEGs on a device, each at its own size, for models that take a
    list of images and resize them inside (detection, segmentation).

    ``encoded`` (decode threads) and ``collate`` (where the batch is built) split the work
    as ``BatchDecoder``'s do; ``collate`` returns the list of uint8 (C, H, W) images on the
    device in item order, items already decoded on the CPU copied over as they are.
    """

    def __init__(
        self, mode: Literal["RGB", "L"], *, max_pixels: int, backend: JpegBackend = "nvjpeg"
    ) -> None:
        """``mode`` is ``RGB`` or ``L``. Raises ``ValueError`` where torchvision has no
        JPEG decoding operators, or nvImageCodec is missing for its ``backend``."""
        if not image_ops_available():
            raise ValueError(
                "decode='gpu' is not available: torchvision is not installed, or this build "
                "has no JPEG decoding operators; use decode='cpu'"
            )
        self.mode = mode
        self._read_mode = READ_MODES[mode]
        self._max_pixels = max_pixels
        self._hardware = HardwareJpeg(mode) if backend == "nvimgcodec" else None

    def encoded(self, payload: bytes) -> torch.Tensor | None:
        """As ``BatchDecoder.encoded``."""
        return encoded_jpeg(payload, self._max_pixels)

    def example(self, width: int, height: int) -> torch.Tensor:
        """An encoded grey JPEG of this size, for warm-up."""
        buffer = io.BytesIO()
        Image.new(self.mode, (width, height), 128).save(buffer, format="JPEG", quality=90)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """The images on ``device``, in item order. Raises ``ContractError(decode_failed)``
        for a JPEG that neither nvJPEG nor Pillow can decode."""
        encoded = [n for n, item in enumerate(items) if item.ndim == 1]
        out = [item if item.ndim == 1 else item.to(device, non_blocking=True) for item in items]
        data = [items[n] for n in encoded]
        if self._hardware is not None and device.type == "cuda" and data:
            decoded = self._hardware.decode(data, device)
        else:
            decoded = decode_each(data, self._read_mode, device)
        for n, image in zip(encoded, decoded, strict=True):
            if image is None:  # refused by the device decoder: Pillow decides
                payload = items[n].numpy().tobytes()
                image = decode_full(
                    payload, ContentType.JPEG, self.mode, max_pixels=self._max_pixels
                ).to(device)
            out[n] = image
        return out


def image_list_decoder(
    decode: DecodeOption, mode: Literal["RGB", "L"], device: torch.device, limits: Limits
) -> ImageListDecoder | None:
    """The device decoder ``decode`` asks for (``auto``: nvJPEG on CUDA), or ``None`` when
    images are decoded on the CPU."""
    if decode == "cpu" or (decode == "auto" and device.type != "cuda"):
        return None
    backend: JpegBackend = "nvimgcodec" if decode == "gpu-hw" else "nvjpeg"
    return ImageListDecoder(mode, max_pixels=limits.max_pixels, backend=backend)


def _cut(weights: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``start .. start + length`` of a resampling matrix; rows outside it are zero
    (black, as torchvision pads a centre crop larger than the image)."""
    out = torch.zeros((length, weights.shape[1]), dtype=weights.dtype)
    first, last = max(start, 0), min(start + length, weights.shape[0])
    if first < last:
        out[first - start : last - start] = weights[first:last]
    return out


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


def _indices(members: Sequence[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Item positions on ``device``, uploaded without blocking the host (pinned memory)."""
    positions = torch.tensor([n for n, _ in members], dtype=torch.long)
    if device.type != "cuda":
        return positions
    return positions.pin_memory().to(device, non_blocking=True)
