"""Text models served by a real worker, against the real broker and Redis.

One ``conveyor worker --config-file host.toml`` serves a text classifier
(``hf:PATH``, a tiny model with a tokenizer trained here: ``tests.text_models``) beside
the digits image model. Text requests (``text/plain``, JSON with and without a pair)
are answered as transformers' pipeline answers them one at a time; every bad input
gets its code (and a dead letter, as any refused request); the image model answers its
own requests; the text model's batches stay within its token budget.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, read_results, tally, until, wait_for_results
from schemas import ContentType, OutgoingRecord, Status, encode_request, topics_for
from tests.harness import digit_requests
from tests.integration.test_host_models import host_file, model_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEXTS = [
    "Return a JSON string.",
    "paths",
    "The logging module defines functions and classes which implement a flexible "
    "event logging system for applications and libraries.",
    "Deserialize a str instance containing a JSON document to a Python object.",
    "Format a string the way textwrap does.",
]
PAIRS = [("Serialize obj to a JSON formatted str.", "json dumps"), ("paths", "files")]
BAD: list[tuple[bytes, ContentType, str]] = [
    (b"\xff\xfe not utf-8", ContentType.TEXT, "decode_failed"),
    (b"  ", ContentType.TEXT, "bad_request"),
    (b'{"txt": "no text key"}', ContentType.JSON, "bad_request"),
    (b"{not json", ContentType.JSON, "decode_failed"),
    (b"\x89PNG\r\n", ContentType.PNG, "unsupported_media_type"),
    (" ".join(["the argument parser parses arguments"] * 20).encode(), ContentType.TEXT, "ok"),
]
COPIES = 8  # each good input this many times: batches form, of several lengths


def text_record(request_id: str, payload: bytes, content_type: ContentType) -> OutgoingRecord:
    return encode_request(payload, request_id=request_id, content_type=content_type, source="tests")


def scores_of(answer: Any) -> list[dict[str, Any]]:
    """The pipeline's classes for one input (nested differently by input and top_k)."""
    if isinstance(answer, dict):
        return [answer]
    return answer[0] if answer and isinstance(answer[0], list) else answer


@pytest.mark.timeout(420)
async def test_a_text_classifier_beside_an_image_model_answers_as_the_pipeline_does(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    text_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    text, image = f"{model_name}t", f"{model_name}i"
    for name in (text, image):
        await create_model_topics(client_settings, name, partitions=2)
    folder = text_models["text-classification"]
    # A budget of 64 tokens: at most 4 rows of 16 or 2 of 32 in a batch (the count: 8).
    path = host_file(
        tmp_path / "host.toml",
        {
            text: {"model": f"hf:{folder}", "max_batch_tokens": "64"},
            image: {"model": "digits"},
        },
    )
    host = workers.start("--config-file", str(path), model="")

    async def serving() -> bool:
        return all([(await model_ready(host, n)).get("ready") for n in (text, image)])

    await until(serving, "both models are ready", 240, host.log, [host])

    good: list[tuple[bytes, ContentType, Any]] = [
        (t.encode(), ContentType.TEXT, t) for t in TEXTS
    ] + [
        (
            json.dumps({"text": a, "text_pair": b}).encode(),
            ContentType.JSON,
            {"text": a, "text_pair": b},
        )
        for a, b in PAIRS
    ]
    records, expected = [], {}
    for copy in range(COPIES):
        for n, (payload, content_type, direct_input) in enumerate(good):
            request_id = f"{text}-g{copy}-{n}"
            records.append(text_record(request_id, payload, content_type))
            expected[request_id] = direct_input
    bad_ids = {}
    for n, (payload, content_type, code) in enumerate(BAD):
        request_id = f"{text}-b{n}"
        records.append(text_record(request_id, payload, content_type))
        bad_ids[request_id] = code
    await produce(kafka_bootstrap, topics_for(text).requests, records)
    digit_records, digit_ids = digit_requests(digits, 24, prefix=f"{image}-d")
    await produce(kafka_bootstrap, topics_for(image).requests, digit_records)

    ids = [*expected, *bad_ids]
    results = await wait_for_results(redis_url, ids, timeout_s=180)
    assert set(results) == set(ids), host.log()[-3000:]

    from transformers import pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = pipeline("text-classification", model=str(folder), device="cpu", top_k=None)
    for request_id, direct_input in expected.items():
        result = results[request_id]
        assert result.status is Status.ok, result
        outputs = result.outputs
        assert isinstance(outputs, dict)
        assert outputs["type"] == "conveyor.text_classification.v1"
        assert outputs["truncated"] is False
        answer = scores_of(direct(direct_input))
        assert [c["label"] for c in outputs["labels"]] == [a["label"] for a in answer]
        served = [c["score"] for c in outputs["labels"]]
        assert served == pytest.approx([a["score"] for a in answer], abs=1e-5)
    for request_id, code in bad_ids.items():
        result = results[request_id]
        if code == "ok":  # past --max-length: cut, and the result says so
            assert result.status is Status.ok, result
            assert isinstance(result.outputs, dict)
            assert result.outputs["truncated"] is True
        else:
            assert result.status is Status.error, result
            assert result.error is not None
            assert result.error.code == code, result

    timings = [r.timings for r in results.values() if r.timings and r.status is Status.ok]
    assert max(t.batch_size for t in timings) > 1  # served in batches
    assert max(t.batch_size for t in timings) <= 4  # none past 64 tokens (4 rows of 16)
    answered = await read_results(redis_url, digit_ids)
    assert set(answered) == set(digit_ids)
    assert {r.model for r in answered.values()} == {image}
    counted = await tally(kafka_bootstrap, redis_url, topics_for(text).results, ids)
    assert counted.lost == 0
