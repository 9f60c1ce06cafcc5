"""``.npy`` payloads (a pipeline's crops) on the batched device path, run on the CPU: the
same batch as the CPU path's Pillow fit within a grey level, mixed with JPEGs and CPU
items in item order, and hostile headers refused with the CPU path's codes.

With ``device="cpu"`` the path is the one the GPU runs (one gathered upload, one resize
per source size), so the tolerance measured here is the one a card gives: the fit is
matrix products in float32 either way.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch

from schemas import ContentType, ContractError, ErrorCode, Limits
from tests.unit.test_gpu_decode import MAX_LEVELS, MEAN_LEVELS, classifier, photo
from workers.decode.gpu import BatchDecoder
from workers.decode.images import Fit, ImageSpec
from workers.model.loader import IMAGENET_IMAGE
from workers.model.runner import ModelRunner

CPU = torch.device("cpu")
LIMITS = Limits(max_pixels=4096 * 4096)


def pixels(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    """Photo-like pixels (a JPEG's, decoded), as a pipeline's crop holds them."""
    from PIL import Image

    image = Image.open(io.BytesIO(photo(width, height, seed)))
    array = np.asarray(image.convert("RGB" if channels == 3 else "L"))
    return array


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# Crop sizes a detector's boxes give: larger than the target, smaller, one of its size,
# and one that is not of its aspect ratio.
CROPS = [(300, 250), (120, 90), (224, 224), (640, 480), (90, 300)]


@pytest.mark.parametrize("fit", ["fast", "reference"])
def test_npy_crops_are_fitted_on_the_device_path_within_tolerance(fit: Fit) -> None:
    image = replace(IMAGENET_IMAGE, fit=fit)
    gpu, cpu = classifier("gpu", image=image), classifier("cpu", image=image)
    payloads = [npy(pixels(w, h, n)) for n, (w, h) in enumerate(CROPS)]

    items = [gpu.preprocess(p, ContentType.NPY, {}) for p in payloads]
    # Raw, fitted per batch; the fast fit takes pixels of the input's size as they are.
    assert [item.ndim for item in items] == [3 if (fit, n) == ("fast", 2) else 4 for n in range(5)]
    batch = gpu.collate(items, CPU)
    expected = torch.stack([cpu.preprocess(p, ContentType.NPY, {}) for p in payloads])

    assert batch is not None
    assert (batch.shape, batch.dtype) == (expected.shape, torch.uint8)
    diff = (batch.int() - expected.int()).abs()
    assert int(diff.max()) <= MAX_LEVELS
    assert float(diff.float().mean()) <= MEAN_LEVELS
    with torch.inference_mode():
        assert torch.equal(gpu.forward(batch).argmax(dim=1), cpu.forward(expected).argmax(dim=1))


def test_npy_jpeg_and_cpu_items_share_a_batch_in_item_order() -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    png = photo(320, 240, 7, fmt="PNG")
    inputs = [
        (npy(pixels(300, 250, 1)), ContentType.NPY),
        (photo(640, 480, 2), ContentType.JPEG),
        (png, ContentType.PNG),
        (npy(pixels(300, 250, 3)), ContentType.NPY),  # the same size as the first: one group
        (npy(pixels(200, 150, 4)), ContentType.NPY),
    ]
    items = [gpu.preprocess(p, t, {}) for p, t in inputs]
    assert [item.ndim for item in items] == [4, 1, 3, 4, 4]

    batch = gpu.collate(items, CPU)

    assert batch is not None
    for n, (payload, content_type) in enumerate(inputs):
        alone = gpu.collate([items[n]], CPU) if items[n].ndim != 3 else items[n][None]
        assert alone is not None
        assert torch.equal(batch[n], alone[0]), n
        expected = cpu.preprocess(payload, content_type, {})
        assert int((batch[n].int() - expected.int()).abs().max()) <= MAX_LEVELS


def test_grayscale_npy_is_spread_to_rgb_as_pillow_converts_it() -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    payloads = [npy(pixels(300, 250, 1, channels=1)), npy(pixels(224, 224, 2, channels=1))]

    batch = gpu.collate([gpu.preprocess(p, ContentType.NPY, {}) for p in payloads], CPU)
    expected = torch.stack([cpu.preprocess(p, ContentType.NPY, {}) for p in payloads])

    assert batch is not None
    assert batch.shape == expected.shape == (2, 3, 224, 224)
    assert int((batch.int() - expected.int()).abs().max()) <= MAX_LEVELS


def test_npy_the_device_path_does_not_convert_stays_on_the_cpu() -> None:
    """RGB pixels for a grayscale model need Pillow's luma weights, and a Fortran-ordered
    array is not one run of bytes: both are left to the CPU path (``raw`` gives None)."""
    rgb_for_grey = BatchDecoder(ImageSpec(16, 16, "L"), max_pixels=10**6)
    rgb = BatchDecoder(IMAGENET_IMAGE, max_pixels=10**6)
    fortran = npy(np.asfortranarray(pixels(300, 250, 2)))

    assert rgb_for_grey.raw(npy(pixels(300, 250, 1))) is None
    assert rgb.raw(fortran) is None
    assert rgb.raw(npy(pixels(300, 250, 1))) is not None
    gpu, cpu = classifier("gpu"), classifier("cpu")
    item = gpu.preprocess(fortran, ContentType.NPY, {})
    assert torch.equal(item, cpu.preprocess(fortran, ContentType.NPY, {}))


def hostile() -> list[tuple[str, bytes, ErrorCode]]:
    good = npy(pixels(64, 48, 1))
    header = good[: len(good) - 64 * 48 * 3]
    huge = npy(np.zeros((1, 1, 3), dtype=np.uint8)).replace(b"(1, 1, 3)", b"(99999, 99999, 3)")
    return [
        ("not npy", b"not an array", ErrorCode.decode_failed),
        ("header cut short", good[:20], ErrorCode.decode_failed),
        ("no pixels", header, ErrorCode.decode_failed),
        ("a byte short", good[:-1], ErrorCode.decode_failed),
        ("a byte more", good + b"\0", ErrorCode.decode_failed),
        ("float32", npy(np.zeros((8, 8, 3), dtype=np.float32)), ErrorCode.decode_failed),
        ("4 channels", npy(np.zeros((8, 8, 4), dtype=np.uint8)), ErrorCode.decode_failed),
        ("4-D", npy(np.zeros((2, 8, 8, 3), dtype=np.uint8)), ErrorCode.decode_failed),
        ("pickle", npy(np.array([{"a": 1}], dtype=object)), ErrorCode.decode_failed),
        ("declares 30 GB", huge, ErrorCode.decode_failed),
        ("too large", npy(np.zeros((5000, 5000), dtype=np.uint8)), ErrorCode.image_too_large),
    ]


@pytest.mark.parametrize(
    ("payload", "code"), [h[1:] for h in hostile()], ids=[h[0] for h in hostile()]
)
def test_a_hostile_npy_is_refused_with_the_cpu_paths_code(payload: bytes, code: ErrorCode) -> None:
    gpu = classifier("gpu", limits=LIMITS)
    with pytest.raises(ContractError) as on_device:
        gpu.preprocess(payload, ContentType.NPY, {})
    with pytest.raises(ContractError) as on_cpu:
        classifier("cpu", limits=LIMITS).preprocess(payload, ContentType.NPY, {})
    assert on_device.value.code == on_cpu.value.code == code


def test_the_runner_answers_npy_crops_as_the_cpu_path_does() -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    payloads = [npy(pixels(w, h, n)) for n, (w, h) in enumerate(CROPS)]
    params = [{"top_k": 1}] * len(payloads)

    on_device = ModelRunner(gpu, "cpu").run(
        [gpu.preprocess(p, ContentType.NPY, {}) for p in payloads], params
    )
    on_cpu = ModelRunner(cpu, "cpu").run(
        [cpu.preprocess(p, ContentType.NPY, {}) for p in payloads], params
    )

    assert [r[0]["label"] for r in on_device] == [r[0]["label"] for r in on_cpu]
