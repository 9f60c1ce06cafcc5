"""A real-time detector (``hf:PATH``, a tiny RT-DETR) served by a real worker process,
against the real broker and Redis.

The folder is what ``save_pretrained`` writes (``tests.detr_models``: random weights,
a 128x96 input in its image processor config). JPEG and PNG frames of several sizes
are answered with ``conveyor.detection.v1`` documents in the submitted frames' pixels,
equal to ``RTDetrForObjectDetection`` run directly on the pixels the worker fitted,
post-processed by transformers' ``post_process_object_detection`` (the unit test's
tolerances: tests/unit/test_detr_detector.py); a payload that is no image is answered
``decode_failed``, a decode bomb ``image_too_large``, a bad ``score_threshold``
``bad_request``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, wait_for_results
from schemas import DEFAULT_LIMITS, ContentType, Status, encode_request, topics_for
from schemas.outputs import DetectionOutput
from tests.detr_models import save_tiny_rtdetr
from tests.unit.test_detr_detector import SIZES, assert_agrees, direct, photo
from tests.unit.test_preprocess import png_header_only
from workers.handlers.tasks.detr import DetrDetector
from workers.model.loader import load_handler

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pytest.importorskip("transformers")

COPIES = 4  # each frame this many times: batches form


@pytest.mark.timeout(300)
async def test_an_rtdetr_worker_answers_as_the_model_does_directly(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "rtdetr"
    model = save_tiny_rtdetr(folder)
    await create_model_topics(client_settings, model_name, partitions=2)
    kinds = [("JPEG", ContentType.JPEG), ("PNG", ContentType.PNG)]
    frames = [(photo(w, h, n, kinds[n % 2][0]), kinds[n % 2][1]) for n, (w, h) in enumerate(SIZES)]
    records, expected = [], {}
    for copy in range(COPIES):
        for n, (payload, content_type) in enumerate(frames):
            request_id = f"{model_name}-{copy}-{n}"
            records.append(
                encode_request(
                    payload,
                    request_id=request_id,
                    content_type=content_type,
                    source="tests",
                    params={"score_threshold": 0.2},
                )
            )
            expected[request_id] = n
    bad = {
        f"{model_name}-text": (b"not an image", ContentType.JPEG, {}, "decode_failed"),
        f"{model_name}-bomb": (
            png_header_only(100_000, 100_000), ContentType.PNG, {}, "image_too_large",
        ),
        f"{model_name}-param": (frames[0][0], frames[0][1], {"score_threshold": 2}, "bad_request"),
    }  # fmt: skip
    for request_id, (payload, content_type, params, _) in bad.items():
        records.append(
            encode_request(
                payload,
                request_id=request_id,
                content_type=content_type,
                source="tests",
                params=params,
            )
        )
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    worker = workers.start("--max-batch-size", "8", model=f"hf:{folder}")

    results = await wait_for_results(redis_url, [*expected, *bad], timeout_s=240)

    assert set(results) == {*expected, *bad}, worker.log()[-3000:]
    for request_id, (*_, code) in bad.items():
        error = results[request_id].error
        assert results[request_id].status is Status.error
        assert error is not None
        assert error.code == code, results[request_id]
    local = load_handler(
        f"hf:{folder}",
        device="cpu",
        weights=None,
        dtype="auto",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        decode="cpu",
    )
    assert isinstance(local, DetrDetector)
    height = local.image.height
    for request_id, n in expected.items():
        result = results[request_id]
        assert result.status is Status.ok, result
        assert result.model_version.startswith("rtdetr:sha256-")
        outputs: Any = result.outputs
        document = DetectionOutput.model_validate(outputs)
        assert (document.width, document.height) == SIZES[n]
        payload, content_type = frames[n]
        pixels = local.preprocess(payload, content_type, {})[None, :, :height]
        assert_agrees(outputs, direct(model, pixels, [SIZES[n]], 0.2 - 1e-9)[0])
    sizes = [r.timings.batch_size for r in results.values() if r.timings]
    assert max(sizes) > 1  # served in batches
