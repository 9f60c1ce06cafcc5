"""The worker end to end: real broker, real Redis, the worker as a real process."""

from __future__ import annotations

import signal

import pytest

from demo.models.digits import DigitsClassifier
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    produce,
    read_results,
    read_topic,
    until_answered,
    wait_for_results,
)
from schemas import ContentType, Result, Status, encode_request, topics_for
from tests.harness import digit_requests
from workers.model.runner import ModelRunner


@pytest.fixture(scope="module")
def direct_predictions(digits: list[tuple[bytes, int]]) -> dict[bytes, dict[str, object]]:
    """The model run directly on each single input: what every served answer must equal."""
    runner = ModelRunner(DigitsClassifier(device="cpu"), device="cpu")
    out = {}
    for png, _digit in digits:
        tensor = runner.handler.preprocess(png, ContentType.PNG, {})
        out[png] = runner.run([tensor], [{}])[0][0]  # top-1 of a batch of one
    return out


@pytest.mark.timeout(240)
async def test_thousand_requests_batched_and_matching_direct_runs(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    direct_predictions: dict[bytes, dict[str, object]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    requests, ids = digit_requests(digits, 1000, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)  # a burst, queued
    workers.start()

    results = await wait_for_results(redis_url, ids, timeout_s=180)
    replies = await read_topic(kafka_bootstrap, topics.results, expect=1000, timeout_s=60)

    assert set(results) == set(ids), workers.logs()
    reply_ids = [r.key.decode() for r in replies]
    assert sorted(reply_ids) == sorted(ids)  # exactly one reply each, ids matching
    for record, request_id in zip(requests, ids, strict=True):
        result = results[request_id]
        assert result.status is Status.ok, result
        assert result.outputs is not None
        top1 = result.outputs[0]
        expected = direct_predictions[record.value]
        assert top1["index"] == expected["index"], request_id
        assert top1["score"] == pytest.approx(expected["score"], abs=1e-4)
    sizes = [r.timings.batch_size for r in results.values() if r.timings]
    assert sum(sizes) / len(sizes) > 1.0  # the burst was served in batches

    # A lone request on the now idle worker is answered without waiting for a full batch.
    png, _ = digits[0]
    lone = encode_request(
        png, request_id=f"{model_name}-lone", content_type=ContentType.PNG, source="tests"
    )
    await produce(kafka_bootstrap, topics.requests, [lone])
    answer = (await wait_for_results(redis_url, [f"{model_name}-lone"], timeout_s=30))[
        f"{model_name}-lone"
    ]
    assert answer.status is Status.ok
    assert answer.timings is not None
    assert answer.timings.batch_size == 1


async def test_plain_kafka_client_request_is_answered(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    from aiokafka import AIOKafkaProducer

    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    png, _digit = digits[3]
    request_id = f"{model_name}-plain"
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:  # headers written by hand, as a Java or Go producer would, from docs/contract.md
        await producer.send_and_wait(
            topics.requests,
            png,
            key=request_id.encode(),
            headers=[
                ("ce_specversion", b"1.0"),
                ("ce_id", request_id.encode()),
                ("ce_type", b"conveyor.request.v1"),
                ("ce_source", b"plain-client"),
                ("content-type", b"image/png"),
                ("ce_params", b'{"top_k": 3}'),
            ],
        )
    finally:
        await producer.stop()
    workers.start()
    result = (await wait_for_results(redis_url, [request_id], timeout_s=60))[request_id]
    assert result.status is Status.ok
    assert len(result.outputs) == 3
    assert result.model == model_name


@pytest.mark.timeout(240)
async def test_bad_inputs_get_error_results_and_dead_letters(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=1)
    png, _ = digits[0]
    good = [
        encode_request(
            png, request_id=f"{model_name}-good-{i}", content_type=ContentType.PNG, source="tests"
        )
        for i in range(20)
    ]
    bad = {
        f"{model_name}-corrupt": (png[: len(png) // 2], ContentType.PNG, "decode_failed"),
        f"{model_name}-text": (b"hello", ContentType.TEXT, "unsupported_media_type"),
        f"{model_name}-huge": (
            b"\x89PNG" + b"\0" * (300 * 1024),
            ContentType.PNG,
            "payload_too_large",
        ),
    }
    records = (
        good[:10]
        + [
            encode_request(payload, request_id=rid, content_type=ctype, source="tests")
            for rid, (payload, ctype, _code) in bad.items()
        ]
        + good[10:]
    )
    await produce(kafka_bootstrap, topics.requests, records)
    workers.start("--max-batch-size", "8", env={"CONVEYOR_LIMITS__MAX_PAYLOAD_BYTES": "262144"})

    ids = [r.key.decode() for r in records]
    results = await wait_for_results(redis_url, ids, timeout_s=120)
    for rid, (_payload, _ctype, code) in bad.items():
        assert results[rid].status is Status.error
        error = results[rid].error
        assert error is not None
        assert error.code == code, results[rid]
    assert all(results[r.key.decode()].status is Status.ok for r in good)

    dead = await read_topic(kafka_bootstrap, topics.dlq, expect=len(bad), timeout_s=30)
    dead_codes = {r.key.decode(): dict(r.headers)["conveyor_error_code"].decode() for r in dead}
    assert dead_codes == {rid: code for rid, (_p, _c, code) in bad.items()}


@pytest.mark.timeout(300)
async def test_sigkill_mid_stream_then_restart_loses_nothing(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    requests, ids = digit_requests(digits, 6000, prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests[:5000])
    first = workers.start("--max-batch-size", "8")

    # Kill as soon as the first results are written: the rest is in flight or queued.
    await until_answered(redis_url, ids[:5000], 100)
    assert first.kill() == -signal.SIGKILL
    answered_at_kill = len(await read_results(redis_url, ids))
    assert 0 < answered_at_kill < 5000, "the kill must land mid-stream"
    await produce(kafka_bootstrap, topics.requests, requests[5000:])  # arrives while no worker runs

    workers.start("--max-batch-size", "8")
    results: dict[str, Result] = await wait_for_results(redis_url, ids, timeout_s=240)
    lost = [i for i in ids if i not in results]
    assert lost == []
    assert all(r.status is Status.ok for r in results.values())


@pytest.mark.timeout(180)
async def test_an_int8_worker_answers_the_heldout_digits_as_the_float_model_does(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
    direct_predictions: dict[bytes, dict[str, object]],
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    requests, ids = digit_requests(digits, len(digits), prefix=model_name)
    await produce(kafka_bootstrap, topics.requests, requests)
    worker = workers.start("--quantize", "int8")

    results = await wait_for_results(redis_url, ids, timeout_s=120)
    assert "2 of 2 linear layers quantized to int8" in worker.log()
    same = 0
    for record, request_id in zip(requests, ids, strict=True):
        result = results[request_id]
        assert result.status is Status.ok, result
        assert result.outputs is not None
        same += result.outputs[0]["index"] == direct_predictions[record.value]["index"]
    assert same >= 0.99 * len(ids), f"{same} of {len(ids)} as the float32 model"
