"""A CLIP dual encoder served by a real worker, against the real broker and Redis.

One ``conveyor worker --model hf:PATH`` serves a tiny CLIP (``tests.image_models``:
random weights, its image processor config, a tokenizer trained here). Images (PNG,
JPEG) and texts (``text/plain``, JSON) go to one request topic, interleaved, so that
batches hold both kinds: each answer says the tower that answered (``modality``) and
equals what the handler answers in-process (``tests/unit/test_hf_images.py`` compares
that with transformers' own calls); bad input gets its code.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, wait_for_results
from schemas import DEFAULT_LIMITS, ContentType, Status, encode_request, topics_for
from schemas.outputs import EmbeddingOutput
from tests.image_models import save_clip
from tests.served_direct import photo_like, pil
from workers.handlers.tasks.dual_encoder import DualEncoder
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pytest.importorskip("transformers")

TEXTS = ["a photo of a cat", "Return a JSON string.", "paths", "a dog on a beach"]
COPIES = 4  # each input this many times: batches form
TOLERANCE = 1e-5  # the same handler, in batches of other sizes and mixes


def jpeg(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    pil(payload).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.timeout(300)
async def test_a_clip_worker_answers_images_and_texts_from_one_topic(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "clip"
    save_clip(folder)
    await create_model_topics(client_settings, model_name, partitions=2)
    inputs: list[tuple[bytes, ContentType]] = []
    for n, text in enumerate(TEXTS):
        image = photo_like(n)
        inputs.append((image, ContentType.PNG) if n % 2 else (jpeg(image), ContentType.JPEG))
        body = json.dumps({"text": text}).encode() if n % 2 else text.encode()
        inputs.append((body, ContentType.JSON if n % 2 else ContentType.TEXT))
    records, expected = [], {}
    for copy in range(COPIES):
        for n, (payload, content_type) in enumerate(inputs):
            request_id = f"{model_name}-{copy}-{n}"
            records.append(
                encode_request(
                    payload, request_id=request_id, content_type=content_type, source="tests"
                )
            )
            expected[request_id] = n
    bad = {
        f"{model_name}-pair": (b'{"text": "a", "text_pair": "b"}', ContentType.JSON, "bad_request"),
        f"{model_name}-png": (b"not an image", ContentType.PNG, "decode_failed"),
        f"{model_name}-blank": (b"  ", ContentType.TEXT, "bad_request"),
    }  # fmt: skip
    for request_id, (payload, content_type, _) in bad.items():
        records.append(
            encode_request(payload, request_id=request_id, content_type=content_type, source="t")
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
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
    )
    assert isinstance(local, DualEncoder)
    items = [local.preprocess(payload, content_type, {}) for payload, content_type in inputs]
    direct = ModelRunner(local, "cpu").run(items, [{}] * len(items))
    for request_id, n in expected.items():
        result = results[request_id]
        assert result.status is Status.ok, result
        document = EmbeddingOutput.model_validate(result.outputs)
        assert document.modality == ("image" if n % 2 == 0 else "text")
        wanted = EmbeddingOutput.model_validate(direct[n]).values()
        np.testing.assert_allclose(document.values(), wanted, atol=TOLERANCE)
    sizes = [r.timings.batch_size for r in results.values() if r.timings]
    assert max(sizes) > 1  # served in batches
