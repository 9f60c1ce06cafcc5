"""The batched device decode path, run on the CPU: same batch as Pillow's path, per-item
fallback, limits from the header, and the runner's collate hook and batch buckets.

With ``device="cpu"`` the path is the one the GPU runs (one decode call per batch,
one resize per source size) with torchvision's CPU JPEG decoder in place of nvJPEG.
That decoder is the same libjpeg-turbo Pillow uses, so only the resize differs here;
on a GPU, nvJPEG's IDCT and chroma upsampling add a level or two more, which
``bench.gpu``'s checks stage measures.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from schemas import ContentType, ContractError, ErrorCode, Limits
from tests.fakes import Echo
from workers.decode import jpeg as device_jpeg
from workers.decode.gpu import BatchDecoder
from workers.decode.images import Fit, ImageSpec
from workers.decode.jpeg import read_jpeg_header
from workers.handlers.base import Collating, ImageClassifier
from workers.model.loader import IMAGENET_IMAGE, IMAGENET_MEAN, IMAGENET_STD, load_handler
from workers.model.runner import ModelRunner, batch_buckets

CPU = torch.device("cpu")
# Tolerances in grey levels (0..255) between the batched path and Pillow's, measured on
# photo-like JPEGs: both apply the same filter weights (the device path builds Pillow's
# as matrices) and differ by rounding only, Pillow resampling in fixed point with an
# 8-bit intermediate, torch in float: at most 1 level anywhere, a fraction on average.
# After normalization one level is 1 / (255 * std) ≈ 0.0175 for ImageNet's std.
# (Sizes here avoid Pillow's draft/reducing_gap shortcuts, taken at 2x downscale or more.)
MAX_LEVELS = 1
MEAN_LEVELS = 0.3


def photo(width: int, height: int, seed: int, fmt: str = "JPEG", **options: Any) -> bytes:
    """Smooth gradient + shapes + noise: compresses like a photo, unlike pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([60 + 120 * x / width, 200 - 150 * y / height, 90 + 0 * x], axis=-1)
    base[height // 4 : height // 2, width // 3 : width // 2] = rng.uniform(0, 255, 3)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def classifier(
    decode: str = "gpu", image: ImageSpec = IMAGENET_IMAGE, **options: Any
) -> ImageClassifier:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(4, 3),
    )  # fmt: skip
    return ImageClassifier(
        module,
        name="tiny",
        version="tiny-v1",
        labels=["a", "b", "c"],
        image=image,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        decode=decode,  # type: ignore[arg-type]
        **options,
    )


# -- the JPEG header ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "marker"),
    [({}, 0xC0), ({"progressive": True}, 0xC2)],
    ids=["baseline", "progressive"],
)
def test_header_gives_the_declared_size(options: dict[str, Any], marker: int) -> None:
    header = read_jpeg_header(photo(64, 48, 0, **options))
    assert header is not None
    assert (header.width, header.height, header.components, header.marker) == (64, 48, 3, marker)
    assert header.device_decodable


def test_cmyk_and_non_jpegs_stay_on_the_cpu() -> None:
    buffer = io.BytesIO()
    Image.new("CMYK", (8, 8)).save(buffer, format="JPEG")
    cmyk = read_jpeg_header(buffer.getvalue())
    assert cmyk is not None
    assert not cmyk.device_decodable
    jpeg = photo(16, 16, 0)
    for data in (photo(16, 16, 0, fmt="PNG"), b"", b"\xff\xd8", jpeg[:20], b"\xff\xd8" + b"x" * 50):
        assert read_jpeg_header(data) is None


def test_declared_size_over_the_limit_is_refused_before_decoding() -> None:
    handler = classifier(limits=Limits(max_pixels=64 * 48 - 1))
    with pytest.raises(ContractError) as caught:
        handler.preprocess(photo(64, 48, 0), ContentType.JPEG, {})
    assert caught.value.code == ErrorCode.image_too_large


def test_a_huge_declared_size_with_a_tiny_body_is_too_large_not_undecodable() -> None:
    data = bytearray(photo(64, 48, 0))
    header = read_jpeg_header(bytes(data))
    assert header is not None
    sof = data.index(bytes([0xFF, header.marker]))
    data[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") * 2  # 60000 x 60000 pixels
    with pytest.raises(ContractError) as caught:
        classifier().preprocess(bytes(data), ContentType.JPEG, {})
    assert caught.value.code == ErrorCode.image_too_large


# -- the batch: same as the CPU path, in order, with per-item fallback -----------------------


def test_batched_path_gives_the_cpu_paths_batch_within_tolerance() -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    payloads = [photo(640, 480, 1), photo(224, 224, 2), photo(640, 480, 3), photo(300, 500, 4)]

    encoded = [gpu.preprocess(p, ContentType.JPEG, {}) for p in payloads]
    assert all(item.ndim == 1 for item in encoded)  # still compressed: decoded per batch
    batch = gpu.collate(encoded, CPU)
    expected = torch.stack([cpu.preprocess(p, ContentType.JPEG, {}) for p in payloads])

    assert batch is not None
    assert (batch.shape, batch.dtype) == (expected.shape, torch.uint8)
    diff = (batch.int() - expected.int()).abs()
    assert int(diff.max()) <= MAX_LEVELS
    assert float(diff.float().mean()) <= MEAN_LEVELS
    with torch.inference_mode():
        outputs = gpu.forward(batch).argmax(dim=1)
        assert torch.equal(outputs, cpu.forward(expected).argmax(dim=1))


def test_png_and_other_items_are_decoded_on_the_cpu_and_keep_their_place() -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    jpeg, png = photo(640, 480, 1), photo(320, 240, 2, fmt="PNG")
    items = [
        gpu.preprocess(p, t, {}) for p, t in [(png, ContentType.PNG), (jpeg, ContentType.JPEG)]
    ]
    assert [item.ndim for item in items] == [3, 1]

    batch = gpu.collate(items, CPU)

    assert batch is not None
    assert torch.equal(batch[0], cpu.preprocess(png, ContentType.PNG, {}))
    assert torch.equal(batch[1], gpu.collate(items[1:], CPU)[0])  # type: ignore[index]


def test_a_jpeg_the_device_decoder_rejects_is_decoded_by_pillow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu, cpu = classifier("gpu"), classifier("cpu")
    payloads = [photo(640, 480, n) for n in range(3)]
    items = [gpu.preprocess(p, ContentType.JPEG, {}) for p in payloads]
    real = device_jpeg.decode_jpegs
    refused = items[1]

    def picky(data: list[torch.Tensor], mode: int, device: torch.device) -> list[torch.Tensor]:
        if any(one is refused for one in data):
            raise RuntimeError("nvjpegDecode failed")  # as nvJPEG reports a bitstream it refuses
        return real(data, mode, device)

    monkeypatch.setattr(device_jpeg, "decode_jpegs", picky)
    batch = gpu.collate(items, CPU)

    assert batch is not None
    assert torch.equal(batch[1], cpu.preprocess(payloads[1], ContentType.JPEG, {}))
    for n in (0, 2):
        assert torch.equal(batch[n], real_path(gpu, payloads[n]))


def real_path(handler: ImageClassifier, payload: bytes) -> torch.Tensor:
    batch = handler.collate([handler.preprocess(payload, ContentType.JPEG, {})], CPU)
    assert batch is not None
    return batch[0]


def test_a_corrupt_jpeg_fails_with_decode_failed() -> None:
    gpu = classifier("gpu")
    good = photo(64, 48, 0)
    header_only = good[: len(good) // 3]  # the header parses; the scan is cut short
    items = [gpu.preprocess(p, ContentType.JPEG, {}) for p in (good, header_only)]
    assert items[1].ndim == 1
    with pytest.raises(ContractError) as caught:
        gpu.collate(items, CPU)
    assert caught.value.code == ErrorCode.decode_failed


def test_a_batch_with_nothing_to_decode_is_left_to_the_runner() -> None:
    gpu = classifier("gpu")
    png = gpu.preprocess(photo(32, 32, 0, fmt="PNG"), ContentType.PNG, {})
    assert gpu.collate([png], CPU) is None
    assert classifier("cpu").collate([png], CPU) is None


def test_grayscale_models_decode_to_one_channel() -> None:
    spec = ImageSpec(16, 16, "L")
    decoder = BatchDecoder(spec, max_pixels=10**6)
    item = decoder.encoded(photo(40, 30, 0))
    assert item is not None
    batch = decoder.collate([item], CPU)
    assert batch is not None
    assert batch.shape == (1, 1, 16, 16)


# -- options -------------------------------------------------------------------------------


def test_decode_auto_is_the_cpu_path_on_a_cpu_and_bad_values_are_refused() -> None:
    assert classifier("auto").batch_decoder is None
    assert classifier("cpu").batch_decoder is None
    assert classifier("gpu").batch_decoder is not None
    with pytest.raises(ValueError, match="auto, cpu, gpu or gpu-hw"):
        classifier("nvjpeg")


def test_gpu_decode_refuses_a_resampling_it_cannot_match() -> None:
    with pytest.raises(ValueError, match="LANCZOS"):
        BatchDecoder(ImageSpec(8, 8, "RGB", resample=Image.Resampling.LANCZOS), max_pixels=100)


def test_auto_precision_is_float32_and_contiguous_on_a_cpu() -> None:
    handler = load_handler(
        "torchvision:resnet18",
        device="cpu",
        weights="random",
        dtype="auto",
        channels_last=None,
        limits=Limits(),
        decode="gpu",
    )
    assert isinstance(handler, ImageClassifier)
    assert handler.dtype == torch.float32
    assert next(handler.module.parameters()).is_contiguous()
    assert handler.batch_decoder is not None


# -- the runner: collate hook, prepare/infer, buckets ---------------------------------------


def test_batch_buckets_are_powers_of_two_up_to_the_maximum() -> None:
    assert batch_buckets(256) == (8, 16, 32, 64, 128, 256)
    assert batch_buckets(100) == (8, 16, 32, 64, 100)
    assert batch_buckets(4) == (4,)
    assert batch_buckets(5, smallest=1) == (1, 2, 4, 5)


def test_a_padded_batch_gives_the_unpadded_results() -> None:
    handler = Echo()
    runner = ModelRunner(handler, "cpu", buckets=(4, 8))
    items = [torch.tensor([n, 1]) for n in range(5)]

    results = runner.run(items, [{}] * 5)

    assert handler.batch_sizes == [8]  # padded up to the bucket
    assert results == [{"out": [10 * n, 10], "params": {}} for n in range(5)]  # padding stripped
    assert ModelRunner(Echo(), "cpu").run(items, [{}] * 5) == results


def test_padding_leaves_a_real_models_outputs_unchanged() -> None:
    handler = classifier("cpu")
    items = [handler.preprocess(photo(64, 48, n), ContentType.JPEG, {}) for n in range(3)]
    params = [{"top_k": 3}] * 3
    padded = ModelRunner(handler, "cpu", buckets=(8,)).run(items, params)
    plain = ModelRunner(handler, "cpu").run(items, params)
    for a, b in zip(padded, plain, strict=True):
        assert [r["index"] for r in a] == [r["index"] for r in b]
        assert [r["score"] for r in a] == pytest.approx([r["score"] for r in b], abs=1e-6)


def test_warm_up_runs_every_bucket_once() -> None:
    handler = Echo()
    ModelRunner(handler, "cpu", buckets=batch_buckets(32)).warm_up([1, 3, 32])
    assert handler.batch_sizes == [8, 16, 32]


def test_runner_builds_batches_with_the_handlers_collate() -> None:
    handler = classifier("gpu")
    assert isinstance(handler, Collating)
    payloads = [photo(640, 480, n) for n in range(3)]
    items = [handler.preprocess(p, ContentType.JPEG, {}) for p in payloads]
    runner = ModelRunner(handler, "cpu")

    prepared = runner.prepare(items)
    results = runner.infer(prepared, [{"top_k": 1}] * 3)

    assert isinstance(prepared.tensor, torch.Tensor)
    assert prepared.tensor.shape == (3, 3, 224, 224)
    assert results == runner.run(items, [{"top_k": 1}] * 3)


# -- each fit batched, and images kept at their own size -----------------------------------


@pytest.mark.parametrize("squash", [False, True])
@pytest.mark.parametrize("fit", ["reference", "fast"])
def test_each_fit_is_batched_within_tolerance_of_the_cpu_path(fit: Fit, squash: bool) -> None:
    """The reference and the fast fit, each also with the squash (timm's crop_mode)."""
    from dataclasses import replace

    reference = replace(IMAGENET_IMAGE, fit=fit, squash=squash)
    gpu, cpu = classifier("gpu", image=reference), classifier("cpu", image=reference)
    payloads = [photo(640, 480, 1), photo(224, 224, 2), photo(300, 500, 4), photo(256, 300, 5)]

    batch = gpu.collate([gpu.preprocess(p, ContentType.JPEG, {}) for p in payloads], CPU)
    expected = torch.stack([cpu.preprocess(p, ContentType.JPEG, {}) for p in payloads])

    assert batch is not None
    assert batch.shape == expected.shape
    diff = (batch.int() - expected.int()).abs()
    assert int(diff.max()) <= MAX_LEVELS
    assert float(diff.float().mean()) <= MEAN_LEVELS


def test_image_lists_are_decoded_at_their_own_size_in_order() -> None:
    from workers.decode.gpu import ImageListDecoder
    from workers.decode.images import decode_full

    decoder = ImageListDecoder("RGB", max_pixels=Limits().max_pixels)
    payloads = [photo(64, 48, 1), photo(30, 70, 2, fmt="PNG"), photo(50, 50, 3)]
    items = [
        decoder.encoded(p) if n != 1 else decode_full(p, ContentType.PNG, "RGB", max_pixels=10**6)
        for n, p in enumerate(payloads)
    ]
    assert [item.ndim for item in items if item is not None] == [1, 3, 1]

    images = decoder.collate([item for item in items if item is not None], CPU)

    assert [tuple(image.shape) for image in images] == [(3, 48, 64), (3, 70, 30), (3, 50, 50)]
    for image, payload, content_type in zip(
        images, payloads, [ContentType.JPEG, ContentType.PNG, ContentType.JPEG], strict=True
    ):
        assert torch.equal(image, decode_full(payload, content_type, "RGB", max_pixels=10**6))


def test_the_engine_gets_batches_padded_to_a_power_of_two() -> None:
    from workers.decode.jpeg import engine_count

    assert [engine_count(n) for n in (1, 2, 3, 5, 8, 9, 200, 256)] == [1, 2, 4, 8, 8, 16, 256, 256]


def test_only_the_largest_batches_go_to_the_hardware_engine() -> None:
    """The engine takes a batch as large (padded) as the largest it has seen; smaller ones,
    which under a light load vary from batch to batch, go to nvJPEG."""
    from workers.decode.jpeg import LargestBatches

    takes = LargestBatches()
    warm_up = [takes(n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert all(warm_up)  # each size the largest so far: the engine warms up on every one
    assert [takes(n) for n in (256, 200, 129, 128, 37, 1)] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
