"""A detector served by a real worker process, against the real broker and Redis.

The worker loads ``torchvision:fasterrcnn_mobilenet_v3_large_320_fpn`` from a weights
file with a labels sidecar and model options, the way a user serves a fine-tuned
detector. Requests are produced with a plain Kafka client and headers written by hand
from docs/contract.md; one result is read back from the reply topic with a plain
Kafka consumer and read as JSON, the way a service in another language would, with
no Conveyor code. Every answer equals the same weights run directly, one image at a
time (the tolerance is the unit test's: tests/unit/test_served_equals_direct.py).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torchvision
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from PIL import Image
from torchvision.transforms.functional import to_tensor

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerProcess, wait_for_results
from schemas import Status, topics_for
from schemas.outputs import DetectionOutput
from tests.served_direct import Agreement, calibrate_detector, photo_like

ARCH = "fasterrcnn_mobilenet_v3_large_320_fpn"
LABELS = ["background", "circle", "square", "triangle", "star"]
OPTIONS = {"min_size": 64, "max_size": 96, "rpn_post_nms_top_n_test": 30,
           "box_detections_per_img": 1000, "box_score_thresh": 0.3}  # fmt: skip
IMAGES = 48


@pytest.fixture(scope="module")
def detector_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A state_dict file (with its labels sidecar) and the module it came from."""
    torch.manual_seed(0)
    module = torchvision.models.get_model(
        ARCH, weights=None, weights_backbone=None, num_classes=len(LABELS), **OPTIONS
    )
    calibrate_detector(module, [photo_like(seed) for seed in range(16)])
    path = tmp_path_factory.mktemp("weights") / "shapes-detector.pt"
    torch.save(module.state_dict(), path)
    path.with_name(f"{path.name}.labels.json").write_text(json.dumps(LABELS))
    return path, module.eval()


@pytest.fixture
def start_detector(
    workers: Fleet, detector_weights: tuple[Path, torch.nn.Module]
) -> Callable[[], WorkerProcess]:
    """Starts the worker serving the detector (once its topics exist)."""
    options = json.dumps({**OPTIONS, "score_threshold": 0.0})
    flags = ("--weights", str(detector_weights[0]), "--model-options", options)
    return lambda: workers.start(*flags, "--max-batch-size", "16", model=f"torchvision:{ARCH}")


def as_jpeg(png: bytes) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def headers(request_id: str, content_type: str, params: dict[str, Any] | None) -> list[Any]:
    """The contract's headers, written by hand as a producer in any language would."""
    out = [
        ("ce_specversion", b"1.0"),
        ("ce_id", request_id.encode()),
        ("ce_type", b"conveyor.request.v1"),
        ("ce_source", b"plain-kafka-test"),
        ("content-type", content_type.encode()),
    ]
    if params is not None:
        out.append(("ce_params", json.dumps(params).encode()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_detector_worker_answers_as_the_model_does_directly(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    start_detector: Callable[[], WorkerProcess],
    detector_weights: tuple[Path, torch.nn.Module],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    pngs = [photo_like(seed) for seed in range(IMAGES)]
    payloads = [
        (p, "image/png") if n % 2 else (as_jpeg(p), "image/jpeg") for n, p in enumerate(pngs)
    ]
    ids = [f"{model_name}-{n}" for n in range(IMAGES)]
    bad = f"{model_name}-bad"
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for request_id, (payload, content_type) in zip(ids, payloads, strict=True):
            params = {"score_threshold": 0.0}
            await producer.send(topics.requests, payload, key=request_id.encode(),
                                headers=headers(request_id, content_type, params))  # fmt: skip
        await producer.send_and_wait(
            topics.requests, pngs[0], key=bad.encode(),
            headers=headers(bad, "image/png", {"score_threshold": 2}),
        )  # fmt: skip
    finally:
        await producer.stop()
    worker = start_detector()

    results = await wait_for_results(redis_url, [*ids, bad], timeout_s=240)

    assert set(results) == {*ids, bad}, worker.log()
    assert results[bad].status is Status.error
    error = results[bad].error
    assert error is not None
    assert error.code == "bad_request"
    assert "ce_params.score_threshold" in error.message
    _, module = detector_weights
    agreement = Agreement()
    with torch.inference_mode():
        for request_id, (payload, _) in zip(ids, payloads, strict=True):
            result = results[request_id]
            assert result.status is Status.ok, result
            assert result.model_version.startswith(f"{ARCH}:sha256-")
            document = DetectionOutput.model_validate(result.outputs)
            image = Image.open(io.BytesIO(payload)).convert("RGB")
            assert (document.width, document.height) == image.size
            assert all(d.label == LABELS[d.index] for d in document.detections)
            agreement.add(result.outputs, module([to_tensor(image)])[0], floor=0.3)
    agreement.check(at_least=IMAGES)
    sizes = [r.timings.batch_size for r in results.values() if r.timings]
    assert max(sizes) > 1  # served in batches


@pytest.mark.timeout(240)
async def test_a_plain_kafka_consumer_reads_a_detection_result(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    model_name: str,
    start_detector: Callable[[], WorkerProcess],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    request_id = f"{model_name}-plain"
    png = photo_like(3)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(
            topics.requests, png, key=request_id.encode(),
            headers=headers(request_id, "image/png", {"score_threshold": 0.0, "max_detections": 5}),
        )  # fmt: skip
    finally:
        await producer.stop()
    start_detector()

    consumer = AIOKafkaConsumer(
        topics.results, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        record = await consumer.getone()  # the worker's first and only answer
    finally:
        await consumer.stop()

    assert record.key == request_id.encode()
    record_headers = dict(record.headers)
    assert record_headers["ce_type"] == b"conveyor.result.v1"
    assert record_headers["ce_subject"] == request_id.encode()
    document = orjson.loads(record.value)  # plain JSON, as docs/contract.md describes it
    assert (document["id"], document["status"], document["error"]) == (request_id, "ok", None)
    outputs = document["outputs"]
    width, height = Image.open(io.BytesIO(png)).size
    assert (outputs["type"], outputs["width"], outputs["height"]) == (
        "conveyor.detection.v1", width, height,
    )  # fmt: skip
    assert 0 < len(outputs["detections"]) <= 5
    scores = [d["score"] for d in outputs["detections"]]
    assert scores == sorted(scores, reverse=True)
    for detection in outputs["detections"]:
        x1, y1, x2, y2 = detection["box"]
        assert 0 <= x1 <= x2 <= width
        assert 0 <= y1 <= y2 <= height
        assert detection["label"] == LABELS[detection["index"]]
