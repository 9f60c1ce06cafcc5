"""Payload decoding: images and .npy arrays to uint8 CHW tensors, and every way they fail."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFilter

from schemas import ContentType, ContractError, ErrorCode
from workers.decode.images import ImageSpec, decode, decode_image, decode_npy

RGB_32 = ImageSpec(height=32, width=32, mode="RGB")
MAX_PIXELS = 40_000_000


def encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a size but holds no pixel data: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def decode_error(payload: bytes, content_type: ContentType, **kwargs: object) -> ContractError:
    max_pixels = kwargs.pop("max_pixels", MAX_PIXELS)
    assert isinstance(max_pixels, int)
    with pytest.raises(ContractError) as caught:
        decode(payload, content_type, RGB_32, max_pixels=max_pixels)
    return caught.value


@pytest.mark.parametrize(
    ("content_type", "fmt", "tolerance"),
    [(ContentType.PNG, "PNG", 0), (ContentType.WEBP, "WEBP", 4), (ContentType.JPEG, "JPEG", 4)],
)
def test_each_image_format_decodes_to_the_target_shape_and_colour(
    content_type: ContentType, fmt: str, tolerance: int
) -> None:
    options = {"lossless": True} if fmt == "WEBP" else {}
    payload = encode(Image.new("RGB", (64, 48), (200, 40, 90)), fmt, **options)

    out = decode(payload, content_type, RGB_32, max_pixels=MAX_PIXELS)

    assert out.dtype == torch.uint8
    assert out.shape == (3, 32, 32)
    assert out.is_contiguous()
    expected = torch.tensor([200, 40, 90], dtype=torch.int16).view(3, 1, 1)
    assert int((out.to(torch.int16) - expected).abs().max()) <= tolerance


def test_grayscale_target_takes_one_channel_from_a_colour_image() -> None:
    payload = encode(Image.new("RGB", (10, 10), (255, 255, 255)), "PNG")
    out = decode(payload, ContentType.PNG, ImageSpec(8, 8, "L"), max_pixels=MAX_PIXELS)
    assert out.shape == (1, 8, 8)
    assert bool((out == 255).all())


@pytest.mark.parametrize("mode", ["P", "RGBA", "LA", "L", "I;16", "CMYK"])
def test_other_colour_modes_are_converted(mode: str) -> None:
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    content_type = ContentType.JPEG if fmt == "JPEG" else ContentType.PNG
    payload = encode(Image.new(mode, (20, 20)), fmt)
    assert decode(payload, content_type, RGB_32, max_pixels=MAX_PIXELS).shape == (3, 32, 32)


def test_center_crop_keeps_the_middle_of_a_wide_image() -> None:
    # 40x20: black sides, a white 20x20 square in the middle; the target is square.
    pixels = np.zeros((20, 40), dtype=np.uint8)
    pixels[:, 10:30] = 255
    payload = encode(Image.fromarray(pixels), "PNG")

    out = decode(payload, ContentType.PNG, ImageSpec(20, 20, "L"), max_pixels=MAX_PIXELS)

    assert bool((out == 255).all())


def test_crop_ratio_zooms_in_like_resize_then_center_crop() -> None:
    # A 16x16 white square centred on a black 32x32 image: keeping half the side
    # (crop_ratio 0.5) leaves only white.
    pixels = np.zeros((32, 32), dtype=np.uint8)
    pixels[8:24, 8:24] = 255
    payload = encode(Image.fromarray(pixels), "PNG")
    spec = ImageSpec(16, 16, "L", crop_ratio=0.5)

    assert bool((decode(payload, ContentType.PNG, spec, max_pixels=MAX_PIXELS) == 255).all())


def test_large_jpeg_decoded_at_reduced_scale_matches_a_full_decode() -> None:
    # A smooth gradient, so the 1/8-scale decode and a full decode agree closely.
    x = np.linspace(0, 255, 1600, dtype=np.float32)
    y = np.linspace(0, 255, 1200, dtype=np.float32)
    rgb = np.stack(
        [np.broadcast_to(x, (1200, 1600)), np.broadcast_to(y[:, None], (1200, 1600)),
         np.full((1200, 1600), 128.0)], axis=2
    ).astype(np.uint8)  # fmt: skip
    payload = encode(Image.fromarray(rgb), "JPEG", quality=95)
    spec = ImageSpec(64, 64, "RGB")

    out = decode(payload, ContentType.JPEG, spec, max_pixels=MAX_PIXELS)

    with Image.open(io.BytesIO(payload)) as full:
        box = (200, 0, 1400, 1200)  # the centered square the crop keeps
        reference = np.asarray(full.convert("RGB").resize((64, 64), box=box))
    diff = out.permute(1, 2, 0).to(torch.int16) - torch.from_numpy(reference.astype(np.int16))
    assert float(diff.abs().float().mean()) < 3.0


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(1, 96),
    height=st.integers(1, 96),
    target_h=st.integers(1, 40),
    target_w=st.integers(1, 40),
    crop_ratio=st.sampled_from([1.0, 0.875, 0.5]),
)
def test_any_image_size_fits_any_target(
    width: int, height: int, target_h: int, target_w: int, crop_ratio: float
) -> None:
    payload = encode(Image.new("RGB", (width, height), (1, 2, 3)), "PNG")
    spec = ImageSpec(target_h, target_w, "RGB", crop_ratio=crop_ratio)
    assert decode(payload, ContentType.PNG, spec, max_pixels=MAX_PIXELS).shape == (
        3,
        target_h,
        target_w,
    )


def test_decoding_is_thread_safe() -> None:
    payloads = [encode(Image.new("L", (40, 30), (v,)), "PNG") for v in range(0, 250, 10)]
    spec = ImageSpec(8, 8, "L")
    with ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(lambda p: decode(p, ContentType.PNG, spec, max_pixels=1200), payloads))
    assert [int(out[0, 0, 0]) for out in outs] == list(range(0, 250, 10))


# -- failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "content_type"), [("PNG", ContentType.PNG), ("JPEG", ContentType.JPEG)]
)
def test_truncated_image_fails_to_decode(fmt: str, content_type: ContentType) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    payload = encode(Image.fromarray(noise), fmt)

    error = decode_error(payload[: len(payload) // 2], content_type)

    assert error.code == ErrorCode.decode_failed
    assert error.field == "value"


def test_corrupt_pixel_data_fails_to_decode() -> None:
    payload = bytearray(encode(Image.new("RGB", (64, 64), (9, 9, 9)), "PNG"))
    start = payload.index(b"IDAT") + 4
    payload[start : start + 16] = b"\xff" * 16  # garbage where the zlib stream starts
    assert decode_error(bytes(payload), ContentType.PNG).code == ErrorCode.decode_failed


@pytest.mark.parametrize("content_type", [ContentType.PNG, ContentType.JPEG, ContentType.WEBP])
def test_bytes_that_are_not_an_image_fail_to_decode(content_type: ContentType) -> None:
    error = decode_error(b"definitely not an image" * 10, content_type)
    assert error.code == ErrorCode.decode_failed
    assert "header" in error.message


def test_image_of_another_format_than_declared_fails_to_decode() -> None:
    payload = encode(Image.new("RGB", (8, 8)), "PNG")
    error = decode_error(payload, ContentType.JPEG)
    assert error.code == ErrorCode.decode_failed
    assert "JPEG" in error.message


@pytest.mark.parametrize("content_type", [ContentType.JSON, ContentType.TEXT])
def test_non_image_content_type_is_unsupported(content_type: ContentType) -> None:
    error = decode_error(b"{}", content_type)
    assert error.code == ErrorCode.unsupported_media_type
    assert error.field == "content-type"


@pytest.mark.timeout(5)
def test_bomb_declaring_ten_billion_pixels_is_refused_from_its_header() -> None:
    # 100000 x 100000 RGB would be 30 GB; the payload is 45 bytes.
    error = decode_error(png_header_only(100_000, 100_000), ContentType.PNG)
    assert error.code == ErrorCode.image_too_large
    assert error.limit == MAX_PIXELS


def test_image_over_max_pixels_is_refused_naming_limit_and_size() -> None:
    error = decode_error(png_header_only(5000, 5000), ContentType.PNG, max_pixels=1_000_000)
    assert error.code == ErrorCode.image_too_large
    assert (error.limit, error.seen) == (1_000_000, 25_000_000)
    assert "5000x5000" in error.message


def test_pillow_bomb_warning_is_refused_whether_or_not_warnings_are_errors() -> None:
    # 10000 x 10000 is past Pillow's warning threshold but not its error one:
    # pytest turns the warning into an exception; a default deployment only warns,
    # and then our own check refuses it.
    payload = png_header_only(10_000, 10_000)
    assert (
        decode_error(payload, ContentType.PNG, max_pixels=10**9).code == ErrorCode.image_too_large
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        error = decode_error(payload, ContentType.PNG)
    assert (error.code, error.seen) == (ErrorCode.image_too_large, 100_000_000)


def test_jpeg_size_is_checked_before_decoding() -> None:
    payload = bytearray(encode(Image.new("RGB", (16, 16)), "JPEG"))
    sof = payload.index(b"\xff\xc0")  # baseline frame header: length, precision, height, width
    payload[sof + 5 : sof + 9] = struct.pack(">HH", 8000, 8000)
    error = decode_error(bytes(payload), ContentType.JPEG)
    assert (error.code, error.seen) == (ErrorCode.image_too_large, 64_000_000)


def test_image_of_exactly_max_pixels_is_accepted() -> None:
    payload = encode(Image.new("RGB", (10, 10)), "PNG")
    assert decode_image(payload, ContentType.PNG, RGB_32, max_pixels=100).shape == (3, 32, 32)


# -- .npy ---------------------------------------------------------------------------------


def test_npy_grayscale_of_the_target_size_is_passed_through_exactly() -> None:
    pixels = np.arange(64, dtype=np.uint8).reshape(8, 8)
    out = decode(npy(pixels), ContentType.NPY, ImageSpec(8, 8, "L"), max_pixels=MAX_PIXELS)
    assert torch.equal(out, torch.from_numpy(pixels)[None])


@pytest.mark.parametrize("order", ["C", "F"])
def test_npy_rgb_becomes_chw(order: Literal["C", "F"]) -> None:
    pixels = np.asarray(np.arange(4 * 6 * 3).reshape(4, 6, 3), dtype=np.uint8, order=order)
    out = decode_npy(npy(pixels), ImageSpec(4, 6, "RGB"), max_pixels=MAX_PIXELS)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1))


def test_npy_of_another_size_is_resized_like_an_image() -> None:
    pixels = np.full((40, 30, 1), 77, dtype=np.uint8)
    out = decode_npy(npy(pixels), RGB_32, max_pixels=MAX_PIXELS)
    assert out.shape == (3, 32, 32)
    assert bool((out == 77).all())


@pytest.mark.parametrize(
    ("array", "words"),
    [
        (np.zeros((8, 8), dtype=np.float32), "uint8"),
        (np.zeros((2, 2, 2, 2), dtype=np.uint8), "shape"),
        (np.zeros((8, 8, 2), dtype=np.uint8), "shape"),
        (np.array([{"a": 1}], dtype=object), "plain numeric"),
    ],
)
def test_npy_of_the_wrong_kind_fails_to_decode(array: np.ndarray, words: str) -> None:
    error = decode_error(npy(array), ContentType.NPY)
    assert error.code == ErrorCode.decode_failed
    assert words in error.message


def test_npy_over_max_pixels_is_refused() -> None:
    error = decode_error(npy(np.zeros((20, 20), dtype=np.uint8)), ContentType.NPY, max_pixels=399)
    assert (error.code, error.seen) == (ErrorCode.image_too_large, 400)


@pytest.mark.timeout(5)
def test_npy_declaring_more_data_than_it_holds_is_refused_without_allocating() -> None:
    # numpy.load would allocate the declared 10^12 bytes before reading 8.
    payload = _npy_with_shape("(1000000, 1000000)") + b"\x00" * 8
    error = decode_error(payload, ContentType.NPY)
    assert error.code == ErrorCode.decode_failed
    assert "declares" in error.message


def _npy_with_shape(shape: str) -> bytes:
    """A version 1.0 .npy header for uint8 data of ``shape``, padded as numpy pads it."""
    header = f"{{'descr': '|u1', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")


@pytest.mark.parametrize("payload", [b"", b"not numpy at all", b"\x93NUMPY\x09\x00garbage"])
def test_bytes_that_are_not_npy_fail_to_decode(payload: bytes) -> None:
    assert decode_error(payload, ContentType.NPY).code == ErrorCode.decode_failed


# -- the reference fit: torchvision's evaluation transform ----------------------------------


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """A gradient with a bright block and noise: sharp edges and fine detail to resample."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([40 + 180 * x / width, 220 - 160 * y / height, 60 + 0 * x], axis=-1)
    base[height // 5 : height // 2, width // 4 : width // 2] = rng.uniform(0, 255, 3)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(1, 700),
    height=st.integers(1, 700),
    arch=st.sampled_from(["resnet50", "inception_v3", "efficientnet_b1", "vit_b_16"]),
)
def test_reference_fit_equals_torchvision_weights_transforms_on_png(
    width: int, height: int, arch: str
) -> None:
    """Within 1 grey level, as the contract for ``reference`` says (in fact exactly)."""
    import torchvision

    reference = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    crop, resize = reference.crop_size[0], reference.resize_size[0]
    spec = ImageSpec(
        height=crop,
        width=crop,
        mode="RGB",
        crop_ratio=crop / resize,
        resample=Image.Resampling[reference.interpolation.name],
        fit="reference",
    )
    image = _photo(width, height, seed=width * 1000 + height)
    payload = encode(image, "PNG")

    ours = decode(payload, ContentType.PNG, spec, max_pixels=MAX_PIXELS)
    theirs = reference(Image.open(io.BytesIO(payload)).convert("RGB"))
    mean = torch.tensor(reference.mean).view(3, 1, 1)
    std = torch.tensor(reference.std).view(3, 1, 1)
    levels = (theirs * std + mean) * 255  # undo the normalization: back to grey levels

    assert ours.shape == theirs.shape
    assert float((ours.float() - levels).abs().max()) <= 1.0


def test_reference_fit_resizes_the_shorter_side_then_crops_the_centre() -> None:
    spec = ImageSpec(height=4, width=4, mode="L", crop_ratio=0.5, fit="reference")  # resize to 8
    stripes = np.tile(np.arange(16, dtype=np.uint8)[None, :] * 16, (8, 1))  # 16 wide, 8 high

    out = decode_npy(npy(stripes), spec, max_pixels=MAX_PIXELS)

    # 16x8 -> 16x8 (already 8 high), then columns 6..9 and rows 2..5 of it.
    assert out[0].tolist() == [[96, 112, 128, 144]] * 4


def test_reference_fit_resizes_even_an_image_of_the_model_size() -> None:
    spec = ImageSpec(height=8, width=8, mode="L", crop_ratio=0.5, fit="reference")
    pixels = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4

    out = decode_npy(npy(pixels), spec, max_pixels=MAX_PIXELS)

    # resized to 16x16 and the middle 8x8 kept: a zoom, not the input passed through
    assert out.shape == (1, 8, 8)
    assert not torch.equal(out[0], torch.from_numpy(pixels))


def test_fast_fit_stays_within_a_few_levels_of_the_reference_on_smooth_images() -> None:
    fast = ImageSpec(height=224, width=224, mode="RGB", crop_ratio=0.875)
    reference = ImageSpec(height=224, width=224, mode="RGB", crop_ratio=0.875, fit="reference")
    payload = encode(_photo(640, 480, seed=1).filter(ImageFilter.GaussianBlur(2)), "PNG")

    a = decode(payload, ContentType.PNG, fast, max_pixels=MAX_PIXELS).int()
    b = decode(payload, ContentType.PNG, reference, max_pixels=MAX_PIXELS).int()

    diff = (a - b).abs().float()
    assert float(diff.mean()) < 3.0  # docs/models.md gives the measured deviation on photos
    assert float(diff.mean()) > 0.0  # and they do differ: two ways of resampling


def test_an_unknown_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="fit must be one of fast, reference"):
        ImageSpec(height=4, width=4, mode="L", fit="exact")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_decode_full_keeps_the_submitted_size(mode: str) -> None:
    from workers.decode.images import decode_full

    image = _photo(37, 23, seed=3)
    out = decode_full(encode(image, "PNG"), ContentType.PNG, mode, max_pixels=MAX_PIXELS)  # type: ignore[arg-type]
    assert out.shape == (3 if mode == "RGB" else 1, 23, 37)
    if mode == "RGB":
        assert torch.equal(out, torch.from_numpy(np.array(image)).permute(2, 0, 1))
    grey = decode_full(npy(np.asarray(image)), ContentType.NPY, mode, max_pixels=MAX_PIXELS)  # type: ignore[arg-type]
    assert grey.shape == out.shape
    with pytest.raises(ContractError) as caught:
        decode_full(encode(image, "PNG"), ContentType.PNG, mode, max_pixels=100)  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.image_too_large
