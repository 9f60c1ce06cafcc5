"""``hf:`` RT-DETR served batch-native (``workers.handlers.tasks.detr``) == the model run directly.

A tiny RT-DETR (``tests.detr_models``: random weights, a 128x96 input in its processor
config) is loaded through the real spec (``hf:PATH``) and served through the real
handler path: ``preprocess``, the runner's ``collate`` and padding to a bucket,
``forward`` with the batched post-processing, the threshold mask and the host half.
Direct: ``RTDetrForObjectDetection`` on the same fitted pixels, then transformers'
``RTDetrImageProcessor.post_process_object_detection`` with the submitted sizes as
target sizes (which maps the boxes back to them).

Tolerances: scores within 1e-5, boxes within 0.01 px, labels equal, the same
detections above a threshold (matched as sets: random weights give scores that differ
in the fifth digit, whose order may swap between a batch and one image). The fitted
pixels are within one grey level of the processor's own resize (Pillow's bilinear on
both sides; the processor works in float, the handler rounds to uint8).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from schemas import DEFAULT_LIMITS, ContentType, ContractError, ErrorCode
from schemas.outputs import DetectionOutput
from tests.detr_models import INPUT, LABELS, QUERIES, save_tiny_rtdetr
from tests.unit.test_preprocess import png_header_only
from workers.config.profiles import tuned
from workers.config.worker import WorkerSettings
from workers.handlers.tasks.detection import DEFAULT_SCORE_THRESHOLD
from workers.handlers.tasks.detr import DEFAULT_GPU_BATCH, DetrDetector
from workers.handlers.weights import ModelLoadError
from workers.model.description import describe
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner, batch_buckets

pytest.importorskip("transformers")

SIZES = [(320, 240), (200, 300), (64, 48), (641, 479)]
BOX_TOLERANCE = 0.01  # pixels of the submitted image
SCORE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("rtdetr")
    return path, save_tiny_rtdetr(path)


def load(path: Path, **kwargs: Any) -> DetrDetector:
    handler = load_handler(
        f"hf:{path}",
        device="cpu",
        weights=kwargs.pop("weights", None),
        dtype="auto",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        **kwargs,
    )
    assert isinstance(handler, DetrDetector)
    return handler


def photo(width: int, height: int, seed: int, fmt: str) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // width), (y * 255 // height), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 60, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


def direct(model: Any, pixels: torch.Tensor, sizes: list[tuple[int, int]], threshold: float) -> Any:
    """The model on uint8 (N, 3, H, W) fitted pixels, post-processed by transformers."""
    from transformers import RTDetrImageProcessor

    with torch.inference_mode():
        out = model(pixel_values=pixels.float() / 255)
    targets = [(height, width) for width, height in sizes]
    processor = RTDetrImageProcessor(size=dict(INPUT))
    return processor.post_process_object_detection(out, threshold=threshold, target_sizes=targets)


def assert_agrees(document: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    found = document["detections"]
    wanted = list(
        zip(
            expected["scores"].tolist(),
            expected["labels"].tolist(),
            expected["boxes"].tolist(),
            strict=True,
        )
    )
    assert len(found) == len(wanted)
    for detection in found:
        match = next(
            (
                n
                for n, (score, label, box) in enumerate(wanted)
                if label == detection["index"]
                and abs(score - detection["score"]) <= SCORE_TOLERANCE
                and np.abs(np.subtract(box, detection["box"])).max() <= BOX_TOLERANCE
            ),
            None,
        )
        assert match is not None, (detection, wanted[:3])
        wanted.pop(match)
        assert detection["label"] == LABELS[detection["index"]]
    scores = [d["score"] for d in found]
    assert scores == sorted(scores, reverse=True)


def test_the_spec_reads_task_labels_and_input_from_the_folder(folder: tuple[Path, Any]) -> None:
    path, _ = folder
    handler = load(path)
    assert handler.labels == LABELS
    assert (handler.image.width, handler.image.height) == (INPUT["width"], INPUT["height"])
    assert handler.image.squash  # resized as the processor does, not letterboxed
    assert handler.max_detections == QUERIES
    assert handler.version.startswith(f"{path.name}:sha256-")
    assert load(path, weights="random").version == f"{path.name}:random-weights"
    assert handler.gpu_batch == DEFAULT_GPU_BATCH
    assert describe(handler, "m", "w").task == "detection"
    settings = tuned(
        WorkerSettings(model="m"),
        cuda=True,
        fixed_size_images=True,
        image_batch=handler.gpu_batch,
        compiles=False,
    )
    # Eager on CUDA unless --compile is given (its compile did not finish in minutes on
    # an H200), its batches bounded for memory.
    assert (settings.compile, settings.max_batch_size) == (False, DEFAULT_GPU_BATCH)
    told = WorkerSettings(model="m", compile=True)
    assert tuned(told, cuda=True, fixed_size_images=True, compiles=False).compile


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_served_boxes_equal_the_model_run_directly(decode: str, folder: tuple[Path, Any]) -> None:
    """``gpu`` on the CPU runs the batched JPEG path (torchvision's CPU decoder, one
    batched resize), ``cpu`` decodes with Pillow in preprocess."""
    path, model = folder
    handler = load(path, decode=decode)
    runner = ModelRunner(handler, "cpu", buckets=batch_buckets(8, smallest=8))
    formats = [("JPEG", ContentType.JPEG), ("PNG", ContentType.PNG)]
    payloads = [
        (photo(w, h, n, formats[n % 2][0]), formats[n % 2][1]) for n, (w, h) in enumerate(SIZES)
    ]
    params: list[dict[str, Any]] = [{"score_threshold": 0.0}, {}, {"score_threshold": 0.3}, {}]
    items = [handler.preprocess(p, t, q) for (p, t), q in zip(payloads, params, strict=True)]
    batch = runner.prepare(items)
    assert isinstance(batch.tensor, torch.Tensor)
    assert batch.tensor.shape == (8, 3, INPUT["height"] + 1, INPUT["width"])  # padded to 8
    results = runner.infer(batch, params)
    pixels = batch.tensor[: len(items), :, : INPUT["height"]]
    for n, (document, p) in enumerate(zip(results, params, strict=True)):
        DetectionOutput.model_validate(document)
        assert (document["width"], document["height"]) == SIZES[n]
        threshold = p.get("score_threshold", handler.score_threshold)
        # transformers keeps scores above the threshold, the handler at least it.
        expected = direct(model, pixels[n : n + 1], [SIZES[n]], threshold - 1e-9)[0]
        assert_agrees(document, expected)
    assert len(results[0]["detections"]) == QUERIES  # threshold 0: every query


def test_fitted_pixels_are_the_processors_resize(folder: tuple[Path, Any]) -> None:
    from transformers import RTDetrImageProcessor

    path, _ = folder
    handler = load(path)
    png = photo(333, 222, 7, "PNG")
    item = handler.preprocess(png, ContentType.PNG, {})
    ours = item[:, : INPUT["height"]].float() / 255
    processor = RTDetrImageProcessor(size=dict(INPUT))
    theirs = processor(images=[Image.open(io.BytesIO(png))], return_tensors="pt")["pixel_values"]
    assert (ours - theirs[0]).abs().max() <= 1 / 255 + 1e-6


def test_params_classes_and_max_detections(folder: tuple[Path, Any]) -> None:
    path, _ = folder
    handler = load(path)
    png = photo(160, 120, 1, "PNG")
    every = handler.preprocess(png, ContentType.PNG, {"score_threshold": 0.0})
    (unfiltered,) = ModelRunner(handler, "cpu").run([every], [{"score_threshold": 0.0}])
    label = unfiltered["detections"][-1]["label"]
    params: list[dict[str, Any]] = [
        {"score_threshold": 0.0, "classes": [label]},
        {"score_threshold": 0.0, "max_detections": 3},
    ]
    items = [handler.preprocess(png, ContentType.PNG, p) for p in params]
    chosen, capped = ModelRunner(handler, "cpu").run(items, params)
    kept = [d for d in unfiltered["detections"] if d["label"] == label]
    # A batch of two computes in other kernel blocks than a batch of one: the same
    # detections, their floats within rounding (6e-8 apart in one run of the suite).
    _same(chosen["detections"], kept)
    _same(capped["detections"], unfiltered["detections"][:3])


def _same(found: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same detections in the same order; scores within 1e-5, corners 1e-3 pixels."""
    assert [(d["label"], d["index"]) for d in found] == [(d["label"], d["index"]) for d in expected]
    for got, want in zip(found, expected, strict=True):
        assert got["score"] == pytest.approx(want["score"], abs=1e-5)
        assert got["box"] == pytest.approx(want["box"], abs=1e-3)  # pixels


@pytest.mark.parametrize(
    ("payload", "content_type", "params", "code"),
    [
        (b"not an image at all", ContentType.JPEG, {}, ErrorCode.decode_failed),
        (png_header_only(100_000, 100_000), ContentType.PNG, {}, ErrorCode.image_too_large),
        (b"{}", ContentType.JSON, {}, ErrorCode.unsupported_media_type),
        (b"", ContentType.PNG, {"score_threshold": 2}, ErrorCode.bad_request),
        (b"", ContentType.PNG, {"score_treshold": 0.2}, ErrorCode.bad_request),
    ],
)
def test_bad_input_gets_its_code(
    folder: tuple[Path, Any],
    payload: bytes,
    content_type: ContentType,
    params: dict[str, Any],
    code: ErrorCode,
) -> None:
    handler = load(folder[0], decode="gpu")
    with pytest.raises(ContractError) as caught:
        handler.preprocess(payload, content_type, params)
    assert caught.value.code is code


def test_a_processor_of_no_fixed_size_is_refused(tmp_path: Path) -> None:
    save_tiny_rtdetr(tmp_path)
    config = tmp_path / "preprocessor_config.json"
    config.write_text(config.read_text().replace('"height": 96', '"shortest_edge": 96'))
    with pytest.raises(ModelLoadError, match="one input size"):
        load(tmp_path)


def test_the_model_option_score_threshold_sets_the_requests_default(
    folder: tuple[Path, Any],
) -> None:
    """As torchvision's detectors take it: a pipeline keeps every box with 0; a request's
    own ``score_threshold`` still wins; a value outside 0..1 is refused at load."""
    path, _ = folder
    assert load(path).score_threshold == DEFAULT_SCORE_THRESHOLD
    assert load(path, options={"score_threshold": 0.0}).score_threshold == 0.0
    for bad in (1.5, -0.1, "0.3", True):
        with pytest.raises(ModelLoadError, match="score_threshold must be from 0 to 1"):
            load(path, options={"score_threshold": bad})
    with pytest.raises(ModelLoadError, match=r"\['resize_size'\] do not apply"):
        load(path, options={"resize_size": 512})
