"""Payload decoding: image and NumPy bytes to a uint8 CHW tensor of the model's input size
(``decode``), or of the image's own size for models that resize inside (``decode_full``).

Pure functions with no shared state, so the worker can run them in a thread pool
(Pillow and NumPy release the GIL while they decode and resize). Every failure
that is the payload's fault raises ``ContractError`` naming the problem; the
checks that bound memory (declared pixels, declared array size) run before any
pixel buffer is allocated.

The output is uint8, not float: it is four times smaller to stack, pin and copy
to the GPU, and the handler normalizes it there.

Two ways to fit an image to a fixed input size (``ImageSpec.fit``, docs/models.md):
``reference`` is torchvision's evaluation transform for pretrained weights (resize
the shorter side, then crop the centre, on a full decode: the same Pillow calls, so
the same pixels); ``fast`` crops and resizes in one pass and lets large JPEGs decode
at a reduced scale, several times cheaper on big photos, a grey level or two away.
"""

from __future__ import annotations

import io
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image, UnidentifiedImageError

from schemas import ContentType, ContractError, ErrorCode
from workers.decode.budget import DecodeBudget

IMAGE_TYPES: dict[ContentType, str] = {
    ContentType.JPEG: "JPEG",
    ContentType.PNG: "PNG",
    ContentType.WEBP: "WEBP",
}
"""Media types decoded as images, with the one Pillow format each may be (no sniffing:
a payload declared ``image/png`` is only ever parsed by the PNG decoder)."""

_VALUE = "value"  # the record field every payload error points at
_NPY_CHANNELS = (1, 3)

Fit = Literal["fast", "reference"]
"""How an image is fitted to a model's input size; see the module doc."""
FITS: tuple[str, ...] = get_args(Fit)


@dataclass(frozen=True)
class ImageSpec:
    """What a model takes as one image, and how any submitted image is fitted to it."""

    height: int
    width: int
    mode: Literal["RGB", "L"]
    """Colour mode of the model input: 3 channels (RGB) or 1 (grayscale)."""
    crop_ratio: float = 1.0
    """Share of the shorter side kept by the center crop: 1.0 keeps the largest centered
    region of the target's aspect ratio; 0.875 is torchvision's resize-256, crop-224."""
    resample: Image.Resampling = Image.Resampling.BILINEAR
    fit: Fit = "fast"
    """``fast``: one crop-and-resize pass, JPEGs decoded at reduced scale when much larger;
    ``reference``: resize the shorter side to ``resize_size``, then crop the centre."""
    squash: bool = False
    """Resize each side by its own factor (timm's ``crop_mode="squash"``): to the target's
    size over ``crop_ratio``, then crop the centre. ``False`` keeps the aspect ratio."""
    floor_crop: bool = False
    """Where ``reference``'s centre crop starts: half the difference rounded, as torchvision's
    ``center_crop`` computes it (``False``), or truncated, as transformers' image
    processors do (``True``): a pixel apart where half the difference ends in .5."""

    def __post_init__(self) -> None:
        if self.height < 1 or self.width < 1:
            raise ValueError(f"image size must be positive, not {self.height}x{self.width}")
        if not 0.0 < self.crop_ratio <= 1.0:
            raise ValueError(f"crop_ratio must be in (0, 1], not {self.crop_ratio}")
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, not {self.fit!r}")

    @property
    def channels(self) -> int:
        return 3 if self.mode == "RGB" else 1

    @property
    def resize_size(self) -> int:
        """The shorter side's length before the centre crop (``reference``): 256 for
        torchvision's 224-pixel crop with ``crop_ratio`` 0.875."""
        return round(min(self.height, self.width) / self.crop_ratio)

    def reference_resize(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) a (width, height) image is resized to before the centre crop
        (``reference``): the shorter side to ``resize_size``, or both (``squash``)."""
        if self.squash:
            return (round(self.width / self.crop_ratio), round(self.height / self.crop_ratio))
        return reference_size(width, height, self.resize_size)


def decode(
    payload: bytes,
    content_type: ContentType,
    spec: ImageSpec,
    *,
    max_pixels: int,
    budget: DecodeBudget | None = None,
) -> torch.Tensor:
    """Decode an image or ``.npy`` payload to a uint8 tensor of shape (C, H, W) per ``spec``.

    Raises ``ContractError`` with ``unsupported_media_type`` for other content types.
    Images wait for room in ``budget`` before their pixels are decoded.
    """
    if content_type in IMAGE_TYPES:
        return decode_image(payload, content_type, spec, max_pixels=max_pixels, budget=budget)
    if content_type == ContentType.NPY:
        return decode_npy(payload, spec, max_pixels=max_pixels)
    raise _unsupported(content_type)


def _unsupported(content_type: ContentType) -> ContractError:
    accepted = ", ".join([*IMAGE_TYPES, ContentType.NPY])
    return ContractError(
        ErrorCode.unsupported_media_type,
        "content-type",
        f"this model takes images; send one of {accepted}",
        seen=str(content_type),
    )


def decode_image(
    payload: bytes,
    content_type: ContentType,
    spec: ImageSpec,
    *,
    max_pixels: int,
    budget: DecodeBudget | None = None,
) -> torch.Tensor:
    """Decode a JPEG, PNG or WebP payload to a uint8 (C, H, W) tensor fitted to ``spec``.

    The declared size is checked against ``max_pixels`` from the header alone, before
    any pixel is decoded; with the ``fast`` fit, JPEGs are decoded at a reduced scale
    when the target is much smaller. With ``budget``, the decode waits for room for its
    pixels first.
    """
    fmt = IMAGE_TYPES[content_type]
    draft = spec if spec.fit == "fast" else None
    with (
        _open_image(payload, fmt, draft, max_pixels) as img,
        _held(budget, img, spec.mode, full=False),
    ):
        _decode_pixels(img, fmt, max_pixels)
        return _to_tensor(np.asarray(_fit(img.convert(spec.mode), spec)))


def decode_full(
    payload: bytes,
    content_type: ContentType,
    mode: Literal["RGB", "L"],
    *,
    max_pixels: int,
    budget: DecodeBudget | None = None,
) -> torch.Tensor:
    """Decode an image or ``.npy`` payload to a uint8 (C, H, W) tensor of its own size,
    converted to ``mode``: for models that resize inside and answer in image pixels.

    Raises ``ContractError`` as ``decode`` does; images wait for room in ``budget``.
    """
    if content_type in IMAGE_TYPES:
        fmt = IMAGE_TYPES[content_type]
        with (
            _open_image(payload, fmt, None, max_pixels) as img,
            _held(budget, img, mode, full=True),
        ):
            _decode_pixels(img, fmt, max_pixels)
            return _to_tensor(np.asarray(img.convert(mode)))
    if content_type == ContentType.NPY:
        pixels = npy_pixels(payload, max_pixels)
        if (pixels.ndim == 3) == (mode == "RGB"):
            return _to_tensor(pixels)
        return _to_tensor(np.asarray(Image.fromarray(np.ascontiguousarray(pixels)).convert(mode)))
    raise _unsupported(content_type)


def _held(
    budget: DecodeBudget | None, img: Image.Image, mode: str, *, full: bool
) -> AbstractContextManager[None]:
    """Room in ``budget`` for decoding ``img`` to ``mode``, or nothing without one."""
    return budget.hold(peak_bytes(img, mode, full=full)) if budget is not None else nullcontext()


def peak_bytes(img: Image.Image, mode: str, *, full: bool) -> int:
    """Memory of a decode of ``img`` to ``mode`` at its peak, every copy counted: the pixels
    as Pillow stores them (four bytes a pixel for RGB as for RGBA, one for L), their
    conversion to ``mode`` (a copy even when the mode is the same), and, for an image
    kept at its own size (``full``), the packed array and the tensor made from it; for a
    fitted image, resampling's intermediates (a reduced copy, then the target's size),
    counted as one more byte a pixel.

    Measured as the rise of peak RSS over one decode (5000 x 5000 pixels, Pillow 13):
    RGBA or JPEG RGB at full size 14 bytes a pixel, L 11 (counted 14 and 11); fitted,
    RGBA 8.1, L 5.1 (counted 9 and 6).
    """
    pixels = img.width * img.height  # after draft(): the reduced size libjpeg decodes to
    held = _stored_bytes(img.mode) + _stored_bytes(mode)
    held += 2 * len(mode) if full else 1  # full: one byte a channel ("RGB" 3, "L" 1) twice
    return pixels * held


def _stored_bytes(mode: str) -> int:
    """Bytes a pixel of ``mode`` takes in Pillow's memory: one for bilevel, L and P, two for
    16-bit modes, four for every other (RGB is stored as RGBX)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


def _open_image(payload: bytes, fmt: str, draft: ImageSpec | None, max_pixels: int) -> Image.Image:
    """Open and check the declared size, no pixels decoded yet; codec failures become errors.

    With ``draft``, a JPEG much larger than that target will decode at a reduced scale."""
    try:
        img = Image.open(io.BytesIO(payload), formats=[fmt])
        check_pixels(img.width, img.height, max_pixels)
        if img.format == "JPEG" and draft is not None:
            # Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is that much
            # smaller: most of the decode cost of a large photo never happens.
            scale = _scale(img.width, img.height, draft)
            img.draft(draft.mode, (math.ceil(img.width * scale), math.ceil(img.height * scale)))
    except ContractError:
        raise
    except Exception as exc:
        raise _image_error(exc, fmt, max_pixels) from exc
    return img


def _decode_pixels(img: Image.Image, fmt: str, max_pixels: int) -> None:
    try:
        img.load()
    except Exception as exc:
        raise _image_error(exc, fmt, max_pixels) from exc


def _image_error(exc: Exception, fmt: str, max_pixels: int) -> ContractError:
    """The ContractError for a codec's failure to open or decode an image."""
    if isinstance(exc, UnidentifiedImageError):
        return ContractError(
            ErrorCode.decode_failed, _VALUE, f"not a {fmt} image (its header is not one)"
        )
    if isinstance(exc, Image.DecompressionBombError | Image.DecompressionBombWarning):
        # Pillow's own guard fires inside Image.open for sizes past its global limit
        # (an error, or a warning that pytest and strict deployments turn into one),
        # before our check can see the size: it is the same refusal.
        return ContractError(
            ErrorCode.image_too_large,
            _VALUE,
            f"the image's declared size is far too large to decode ({exc})",
            limit=max_pixels,
        )
    # Codecs report bad bytes as OSError, SyntaxError, ValueError, struct.error,
    # zlib.error and more; on untrusted input every one of them means the same thing.
    return ContractError(ErrorCode.decode_failed, _VALUE, f"not a valid {fmt} image: {exc}")


def decode_npy(payload: bytes, spec: ImageSpec, *, max_pixels: int) -> torch.Tensor:
    """Decode an ``application/x-npy`` payload (what ``numpy.save`` writes) of uint8 pixels.

    The array must be (H, W) or (H, W, C) with C in {1, 3}, like an image read with
    Pillow or OpenCV (channels in RGB order). It is fitted to ``spec`` like an image.
    """
    pixels = npy_pixels(payload, max_pixels)
    height, width = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else 3
    if spec.fit == "fast" and (height, width, channels) == (spec.height, spec.width, spec.channels):
        return _to_tensor(pixels)
    img = Image.fromarray(np.ascontiguousarray(pixels))  # 2-D gives "L", 3 channels "RGB"
    if img.mode != spec.mode:  # convert copies even to the same mode: a crop's worth of bytes
        img = img.convert(spec.mode)
    return _to_tensor(np.asarray(_fit(img, spec)))


def npy_pixels(payload: bytes, max_pixels: int) -> npt.NDArray[np.uint8]:
    """The uint8 (H, W) or (H, W, 3) pixels of a ``.npy`` payload, viewed in place (no
    copy), its header, dtype, shape and size checked before any pixel is touched:
    ``ContractError(decode_failed)`` or ``ContractError(image_too_large)`` otherwise."""
    pixels = _read_npy(payload)
    if pixels.dtype != np.uint8:
        raise ContractError(
            ErrorCode.decode_failed, _VALUE, "expected uint8 pixels", seen=str(pixels.dtype)
        )
    if pixels.ndim == 3 and pixels.shape[2] in _NPY_CHANNELS:
        if pixels.shape[2] == 1:
            pixels = pixels[:, :, 0]
    elif pixels.ndim != 2:
        raise ContractError(
            ErrorCode.decode_failed,
            _VALUE,
            "expected an array of shape (H, W), (H, W, 1) or (H, W, 3)",
            seen=str(pixels.shape),
        )
    height, width = pixels.shape[:2]
    check_pixels(width, height, max_pixels)
    return pixels


def read_npy(payload: bytes) -> npt.NDArray[Any]:
    """A ``.npy`` payload's array, viewed in place, its declared size checked first
    (``ContractError(decode_failed)`` otherwise)."""
    return _read_npy(payload)


def _read_npy(payload: bytes) -> npt.NDArray[Any]:
    """Parse the .npy header and view the data in place, checking sizes first.

    ``numpy.load`` on a byte stream allocates the declared shape before reading
    the data, so a 100-byte payload could ask for terabytes; here the declared
    size must match the bytes actually present.
    """
    stream = io.BytesIO(payload)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except ValueError as exc:
        raise ContractError(
            ErrorCode.decode_failed, _VALUE, f"not a valid .npy array: {exc}"
        ) from exc
    if dtype.hasobject or dtype.fields is not None:
        raise ContractError(
            ErrorCode.decode_failed, _VALUE, "expected a plain numeric array", seen=str(dtype)
        )
    offset = stream.tell()
    expected = math.prod(shape) * dtype.itemsize
    if len(payload) - offset != expected:
        raise ContractError(
            ErrorCode.decode_failed,
            _VALUE,
            f"the .npy header declares {shape} {dtype} ({expected} bytes of data)",
            seen=f"{len(payload) - offset} bytes of data",
        )
    flat = np.frombuffer(payload, dtype=dtype, count=math.prod(shape), offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """Raise ``ContractError(image_too_large)`` for a declared size above ``max_pixels``."""
    if width * height > max_pixels:
        raise ContractError(
            ErrorCode.image_too_large,
            _VALUE,
            f"the image is {width}x{height}; send a smaller one",
            limit=max_pixels,
            seen=width * height,
        )


def _scale(width: int, height: int, spec: ImageSpec) -> float:
    """Scale factor that makes the center crop of a (width, height) image cover the target."""
    return max(spec.width / width, spec.height / height) / spec.crop_ratio


def crop_box(width: int, height: int, spec: ImageSpec) -> tuple[float, float, float, float]:
    """The (left, top, right, bottom) region of a (width, height) image that ``spec`` keeps:
    centered, of the target's aspect ratio, ``crop_ratio`` of the shorter side (with
    ``squash``: ``crop_ratio`` of each side)."""
    if spec.squash:
        box_w, box_h = width * spec.crop_ratio, height * spec.crop_ratio
    else:
        scale = _scale(width, height, spec)
        box_w, box_h = spec.width / scale, spec.height / scale
    left, top = (width - box_w) / 2, (height - box_h) / 2
    # Clamped: float rounding can put an edge a hair outside the image.
    return (max(left, 0.0), max(top, 0.0), min(left + box_w, width), min(top + box_h, height))


def reference_size(width: int, height: int, short: int) -> tuple[int, int]:
    """(width, height) after resizing the shorter side to ``short``, the longer one in
    proportion and truncated, as torchvision's ``resize(img, [short])`` computes it."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def reference_crop(size: int, crop: int, *, floor: bool = False) -> int:
    """Where torchvision's ``center_crop`` starts a ``crop``-long cut along a ``size``-long
    side: negative when it pads (with black) because the side is shorter than the crop.
    ``floor``: where transformers' image processors start it (``ImageSpec.floor_crop``)."""
    if crop > size:
        return -((crop - size) // 2)
    if floor:
        return (size - crop) // 2
    return round((size - crop) / 2.0)


def _fit(img: Image.Image, spec: ImageSpec) -> Image.Image:
    """Fit ``img`` to the target as ``spec.fit`` says."""
    if spec.fit == "reference":
        return _fit_reference(img, spec)
    return _fit_fast(img, spec)


def _fit_reference(img: Image.Image, spec: ImageSpec) -> Image.Image:
    """torchvision's ``Resize(resize_size)`` (``Resize((resize_size, resize_size))`` with
    ``squash``) then ``CenterCrop``, with the same Pillow calls it makes on a PIL image (a
    crop box outside the image fills with black, as torchvision's padding does)."""
    width, height = spec.reference_resize(img.width, img.height)
    if (width, height) != img.size:
        img = img.resize((width, height), spec.resample)
    left = reference_crop(width, spec.width, floor=spec.floor_crop)
    top = reference_crop(height, spec.height, floor=spec.floor_crop)
    if (left, top, width, height) == (0, 0, spec.width, spec.height):
        return img
    return img.crop((left, top, left + spec.width, top + spec.height))


def _fit_fast(img: Image.Image, spec: ImageSpec) -> Image.Image:
    """Center-crop and resize to the target in one resampling pass (``resize`` with a box)."""
    box = crop_box(img.width, img.height, spec)
    if img.size == (spec.width, spec.height) and box == (0, 0, img.width, img.height):
        return img
    # reducing_gap lets Pillow shrink large images by integer factors first (fast),
    # then resample the rest; 3.0 is indistinguishable from a full resample.
    return img.resize((spec.width, spec.height), spec.resample, box=box, reducing_gap=3.0)


def _to_tensor(pixels: npt.NDArray[np.uint8]) -> torch.Tensor:
    """(H, W) or (H, W, C) uint8 pixels to a contiguous (C, H, W) tensor: one copy.

    The copy is needed anyway: Pillow's and ``frombuffer``'s arrays are read-only,
    and torch tensors must own writable memory.
    """
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return torch.from_numpy(np.array(chw, dtype=np.uint8, order="C"))
