"""JPEG payloads on a device: which ones it can decode, and the decoders that do it.

- ``read_jpeg_header`` reads the markers up to the start of frame (microseconds, no
  entropy-coded data), so a payload's declared size is checked before any decoder
  sees it, and a JPEG nvJPEG would decode differently from Pillow (CMYK, 12-bit,
  arithmetic-coded) stays on the CPU;
- ``encoded_jpeg`` turns a payload the device takes into the 1-D tensor the
  decoders read;
- ``decode_jpegs`` is torchvision's nvJPEG decode of a whole batch (the CPU
  operator elsewhere), ``decode_each`` finds the images of a batch it refuses, and
  ``HardwareJpeg`` is the GPU's hardware JPEG engine (nvImageCodec).

``workers.decode.gpu`` fits the decoded images to a model's input.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Literal

import torch
from torch.utils.dlpack import from_dlpack

from workers.decode.cuda_sync import event as cuda_event
from workers.decode.images import check_pixels

JpegBackend = Literal["nvjpeg", "nvimgcodec"]  # CUDA nvJPEG, or the hardware engine (HardwareJpeg)

READ_MODES = {"RGB": 3, "L": 1}
"""``torchvision.io.ImageReadMode`` values by Pillow mode, for ``decode_jpegs``."""

# Frame types nvJPEG decodes: baseline, extended sequential and progressive Huffman.
# Lossless and arithmetic-coded JPEGs (rare) take the CPU path.
_NVJPEG_SOF = frozenset({0xC0, 0xC1, 0xC2})
# Every start-of-frame marker: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_ALL_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers with no length field: TEM, RST0-7 (SOI is consumed before the loop).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


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


def encoded_jpeg(payload: bytes, max_pixels: int) -> torch.Tensor | None:
    """A JPEG payload as a 1-D uint8 tensor for a device decoder, or ``None`` when it must
    be decoded on the CPU. Raises ``ContractError(image_too_large)`` from the header alone."""
    header = read_jpeg_header(payload)
    if header is None or not header.device_decodable:
        return None
    check_pixels(header.width, header.height, max_pixels)
    # One copy: the record value is immutable bytes, and torch warns on wrapping
    # read-only memory. A memcpy of ~150 KB is microseconds, far below a decode.
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def decode_each(
    data: list[torch.Tensor], mode: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Decoded (C, H, W) images on ``device``; ``None`` where the decoder refused one."""
    if not data:
        return []
    try:
        return list(decode_jpegs(data, mode, device))
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError:
        pass
    # The batched call fails as a whole, without saying which image: find them.
    decoded: list[torch.Tensor | None] = []
    for one in data:
        try:
            decoded.append(decode_jpegs([one], mode, device)[0])
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:
            decoded.append(None)
    return decoded


def decode_jpegs(data: list[torch.Tensor], mode: int, device: torch.device) -> list[torch.Tensor]:
    """Decode encoded JPEGs (1-D uint8 CPU tensors) to (C, H, W) uint8 images on ``device``:
    one batched nvJPEG call on CUDA. ``mode`` is a ``READ_MODES`` value. Raises
    ``RuntimeError`` if any image fails, without saying which.

    These are torchvision's JPEG decoders, called as operators.

    ``torchvision.io.decode_jpeg`` does exactly this, but since torchvision 0.29 it also
    emits a DeprecationWarning on every call (pointing at TorchCodec, which has no
    batched nvJPEG decode yet); the operators themselves are unchanged since 0.19.
    """
    if not image_ops_available():
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
def image_ops_available() -> bool:
    """Whether torchvision's image operators are registered with ``torch.ops``.

    Importing ``torchvision.io`` registers them; it happens here, not at the top, so
    that only the device decode path pays for the import.
    """
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.image, "decode_jpeg")


class HardwareJpeg:
    """The GPU's hardware JPEG engine through nvImageCodec, CUDA nvJPEG behind it for the
    images the engine declines (progressive ones, say).

    ``decode_batch`` is the fast path: a batch of one image size is decoded straight into
    one (N, H, W, C) buffer kept for that size, which costs the host a few microseconds an
    image; ``decode`` hands each image over through DLPack (on an H100 that cut the
    engine's rate on 224x224 images by 40%) and serves batches of mixed sizes. The decoder
    orders its work on the current stream (its ``cuda_stream``), so later work on it sees
    the images. Batches reach the engine padded to a power of two (``engine_count``), and
    only the largest ones (``takes``): smaller batches go to nvJPEG.

    EXIF orientation is ignored, as Pillow's and nvJPEG's paths ignore it.
    """

    _SIZES = 2  # image sizes whose buffers are kept
    _RING = 2  # buffers a size: the next batch is decoded while the last one is read
    _BUFFER_BYTES = 1 << 28  # larger batches take the per-image path

    def __init__(self, mode: str) -> None:
        try:
            from nvidia import nvimgcodec
        except ImportError as exc:
            raise ValueError(
                "decode='gpu-hw' needs nvImageCodec: pip install nvidia-nvimgcodec-cu13"
            ) from exc
        self._nvimgcodec = nvimgcodec
        self._decoders: dict[int, Any] = {}
        self._channels = 3 if mode == "RGB" else 1
        color = nvimgcodec.ColorSpec.SRGB if mode == "RGB" else nvimgcodec.ColorSpec.GRAY
        self._params = nvimgcodec.DecodeParams(
            color_spec=color, allow_any_depth=False, apply_exif_orientation=False
        )
        self._rings: OrderedDict[tuple[int, int, int, int], _Ring] = OrderedDict()
        self.takes = LargestBatches()

    def decode(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """Decoded (C, H, W) images, each its own tensor; ``None`` where the engine and
        nvJPEG both refused one."""
        return self._each(self._sources(data), device)

    @contextmanager
    def decode_batch(
        self, data: list[torch.Tensor], device: torch.device
    ) -> Iterator[torch.Tensor | list[torch.Tensor | None]]:
        """The batch decoded, valid inside the ``with`` block: a uint8 (N, C, H, W) view of a
        reused buffer when all are of one size (and fit in 256 MiB) and all decoded, else a
        list of (C, H, W) images with ``None`` where one was refused. Work reading it must
        be queued on the current stream before the block ends; the buffer is not written
        again until that work has run."""
        sources = self._sources(data)
        size = (sources[0].height, sources[0].width)
        count = engine_count(len(data))
        too_big = count * size[0] * size[1] * self._channels > self._BUFFER_BYTES
        if too_big or any((source.height, source.width) != size for source in sources):
            yield self._each(sources, device)
            return
        stream = torch.cuda.current_stream(device)
        buffer = self._ring(device, stream, size).take(count, self._channels)
        decoded = self._decoder(device).decode(
            _padded(sources, count),
            images=buffer.images[:count],
            params=self._params,
            cuda_stream=stream.cuda_stream,
        )[: len(data)]
        batch = buffer.pixels[: len(data)].permute(0, 3, 1, 2)
        try:
            if all(image is not None for image in decoded):
                yield batch
            else:
                yield [None if image is None else batch[n] for n, image in enumerate(decoded)]
        finally:
            buffer.read_by(stream)

    def _each(self, sources: list[Any], device: torch.device) -> list[torch.Tensor | None]:
        stream = torch.cuda.current_stream(device)
        images = self._decoder(device).decode(
            _padded(sources, engine_count(len(sources))),
            params=self._params,
            cuda_stream=stream.cuda_stream,
        )[: len(sources)]
        return [None if image is None else from_dlpack(image).permute(2, 0, 1) for image in images]

    def _sources(self, data: list[torch.Tensor]) -> list[Any]:
        return [self._nvimgcodec.CodeStream(one.numpy()) for one in data]

    def _decoder(self, device: torch.device) -> Any:
        nvimgcodec = self._nvimgcodec
        index = _index(device)
        decoder = self._decoders.get(index)
        if decoder is None:
            backends = [
                nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY),
            ]
            decoder = self._decoders[index] = nvimgcodec.Decoder(device_id=index, backends=backends)
        return decoder

    def _ring(
        self, device: torch.device, stream: torch.cuda.Stream, size: tuple[int, int]
    ) -> _Ring:
        """The buffers for one image size on one stream, the least recently used size's
        buffers dropped beyond ``_SIZES`` (the caching allocator orders their reuse after
        the work queued on this stream)."""
        key = (_index(device), stream.cuda_stream, *size)
        ring = self._rings.pop(key, None) or _Ring(self._nvimgcodec, device, stream, size)
        self._rings[key] = ring
        while len(self._rings) > self._SIZES:
            self._rings.popitem(last=False)[1].drain()
        return ring


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class LargestBatches:
    """Which batches go to the engine: one as large as the largest it has seen (a full
    batch, under load; warm-up runs every size up to the largest).

    The engine's cost follows the batch sizes it is handed more than the images in them:
    sizes that changed from call to call stalled it for 0.4 s (one H100, sizes 1-64 at
    random), and eight workers at half the peak, each handing it batches of a few dozen
    images padded to the next power of two, held requests 2.6 s at the median
    (docs/benchmarks.md). A smaller batch is decoded with nvJPEG instead, which costs
    what its images cost; full batches, where the engine is fastest, stay on it."""

    def __init__(self) -> None:
        self.largest = 0  # padded (``engine_count``)

    def __call__(self, count: int) -> bool:
        padded = engine_count(count)
        self.largest = max(self.largest, padded)
        return padded == self.largest


def engine_count(count: int) -> int:
    """How many images to hand the engine for a batch of ``count``: the next power of two.
    nvImageCodec's engine path stalled for 0.4-0.5 s on some calls when the batch size
    changed from call to call (one H100, sizes 1-64 at random; the worst call of nvJPEG's
    path: 9 ms); padded so, its worst call took 15 ms. Under a full load batches are the
    maximum batch size, a power of two by default (256), so nothing is padded."""
    return 1 << (count - 1).bit_length() if count > 1 else 1


def _padded(sources: list[Any], count: int) -> list[Any]:
    """``sources`` made ``count`` long by repeating the last one (decoded, then dropped)."""
    return sources + [sources[-1]] * (count - len(sources))


class _Buffer:
    """One (capacity, H, W, C) uint8 device buffer, the nvImageCodec image over each slot,
    and an event recorded once the work reading it was queued."""

    def __init__(
        self,
        nvimgcodec: Any,
        device: torch.device,
        stream: torch.cuda.Stream,
        shape: tuple[int, int, int, int],
    ) -> None:
        self.pixels = torch.empty(shape, dtype=torch.uint8, device=device)
        self.images = [
            nvimgcodec.as_image(self.pixels[n], cuda_stream=stream.cuda_stream)
            for n in range(shape[0])
        ]
        self._read: torch.cuda.Event | None = None

    def wait_until_read(self) -> None:
        if self._read is not None:
            self._read.synchronize()

    def read_by(self, stream: torch.cuda.Stream) -> None:
        self._read = cuda_event()
        self._read.record(stream)


class _Ring:
    """``HardwareJpeg._RING`` buffers for one image size, taken in turn."""

    def __init__(
        self,
        nvimgcodec: Any,
        device: torch.device,
        stream: torch.cuda.Stream,
        size: tuple[int, int],
    ) -> None:
        self._make = partial(_Buffer, nvimgcodec, device, stream)
        self._size = size
        self._buffers: list[_Buffer | None] = [None] * HardwareJpeg._RING
        self._next = 0

    def take(self, count: int, channels: int) -> _Buffer:
        """The next buffer, grown to ``count`` images, once the reads of its last batch ran."""
        n = self._next
        self._next = (n + 1) % len(self._buffers)
        buffer = self._buffers[n]
        if buffer is not None:
            # Also before a smaller buffer is dropped: the decoder writes from streams of
            # its own, which the caching allocator's stream order does not cover.
            buffer.wait_until_read()
        if buffer is None or len(buffer.images) < count:
            buffer = self._buffers[n] = self._make((count, *self._size, channels))
        return buffer

    def drain(self) -> None:
        """Wait until the last reads of every buffer ran, before they are dropped."""
        for buffer in self._buffers:
            if buffer is not None:
                buffer.wait_until_read()
