"""A pipeline of two models on real workers, the real broker and Redis: the demo detector
finds the digits of each scene, and the demo classifier reads every box.

Requests go to the detector alone (``--then`` names the classifier); the caller waits on
the request's id as for any model, and gets one answer: the detector's document with
each box's classification under ``next``. Every answer equals the two models run
directly: the detector on the image, the classifier on the crops of the served boxes.
The crash test SIGKILLs a detector worker while crops are in flight and a classifier
worker while it answers them: nothing is lost, no box is answered twice, and no answer
changes once a caller could read it.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from PIL import Image

from demo.models.detector import DigitsDetector
from demo.models.digits import DigitsClassifier
from demo.models.scenes import DigitSet, random_scene
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerProcess, produce, read_topic, wait_for_results
from producers.testing.kafka import requests
from producers.testing.results import until_answered
from producers.video.ids import frame_request_id
from producers.video.reader import AsyncStreamReader
from schemas import ContentType, Status, encode_request, result_key, topics_for
from schemas.chain import child_id
from tests.harness import metrics
from workers.chain.crops import cut
from workers.model.runner import ModelRunner

DETECTOR = "demo.models.detector:DigitsDetector"
MARGIN = 0.1
CROP_LIMITS = {"max_pixels": 10**8, "limit": 10**6}  # crops of the same pixels: .npy or PNG
THEN = json.dumps({"min_score": 0.4, "max_children": 8, "margin": MARGIN})
SCENES = 120


def scene_pngs(count: int, seed: int) -> list[bytes]:
    """Scenes of one to four held-out digits, as PNG."""
    digits, rng = DigitSet.load(heldout=True), np.random.default_rng(seed)
    pngs = []
    for _ in range(count):
        canvas, _boxes = random_scene(digits, rng)
        pixels = (canvas.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    return pngs


@pytest.fixture(scope="module")
def scenes(detector: Path) -> list[bytes]:
    return scene_pngs(SCENES, seed=11)


@pytest.fixture(scope="module")
def direct(detector: Path, digits: Any) -> tuple[ModelRunner, ModelRunner]:
    """The detector and the classifier, run in this process, one input at a time."""
    return (
        ModelRunner(DigitsDetector(device="cpu"), device="cpu"),
        ModelRunner(DigitsClassifier(device="cpu"), device="cpu"),
    )


def answer(runner: ModelRunner, payload: bytes, content_type: ContentType = ContentType.PNG) -> Any:
    tensor = runner.handler.preprocess(payload, content_type, {})
    return runner.run([tensor], [{}])[0]


def check_answer(
    request_id: str,
    payload: bytes,
    outputs: dict[str, Any],
    direct: tuple[ModelRunner, ...],
    content_type: ContentType = ContentType.PNG,
) -> int:
    """``outputs`` is the two models' answer for ``payload``; returns its box count."""
    detector, classifier = direct
    alone = answer(detector, payload, content_type)
    served = outputs["detections"]
    assert len(served) == len(alone["detections"]), (request_id, served, alone)
    for got, want in zip(served, alone["detections"], strict=True):
        assert got["label"] == want["label"]
        assert got["box"] == pytest.approx(want["box"], abs=1e-3)
        assert got["score"] == pytest.approx(want["score"], abs=1e-4)
    assert outputs["pipeline"]["children"] == len(served)
    assert outputs["pipeline"]["failed"] == []
    crops = cut(payload, content_type, [d["box"] for d in served], MARGIN, **CROP_LIMITS)
    for index, (found, crop) in enumerate(zip(served, crops, strict=True)):
        then = found["next"]
        assert then["id"] == child_id(request_id, index)  # each box answered once, by its own child
        assert then["status"] == "ok", then
        want = answer(classifier, crop.data, crop.content_type)
        assert then["outputs"][0]["label"] == want[0]["label"]
        assert then["outputs"][0]["score"] == pytest.approx(want[0]["score"], abs=1e-5)
    return len(served)


async def made(
    settings: ClientSettings, drop_topics: list[str], partitions: int, *models: str
) -> None:
    """Each model's topics, deleted after the test."""
    for model in models:
        await create_model_topics(settings, model, partitions=partitions)
        drop_topics.append(model)


def start_pair(workers: Fleet, classifier_name: str) -> list[WorkerProcess]:
    """A classifier worker, then a detector worker whose boxes go to it."""
    return [
        workers.start("--model-name", classifier_name, model="digits"),
        workers.start(
            "--then", classifier_name, "--then-options", THEN, "--max-batch-size", "16",
            model=DETECTOR,
        ),
    ]  # fmt: skip


@pytest.mark.timeout(420)
async def test_every_box_of_every_image_is_classified_in_one_answer(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
    direct: tuple[ModelRunner, ModelRunner],
) -> None:
    classifier = f"{model_name}c"
    await made(client_settings, drop_topics, 3, model_name, classifier)
    records, ids = requests(scenes, 1000, model_name, ContentType.PNG)
    stream = f"cam-{model_name}"
    frames = [
        encode_request(
            scenes[seq % len(scenes)],
            request_id=frame_request_id(stream, seq),
            content_type=ContentType.PNG,
            source="tests",
            stream=stream,
            seq=seq,
        )
        for seq in range(40)
    ]
    reader_worker, detector_worker = start_pair(workers, classifier)
    async with AsyncStreamReader(client_settings, model_name, stream, timeout=120) as reader:
        await produce(kafka_bootstrap, topics_for(model_name).requests, records + frames)
        in_order = [frame async for frame in reader.results(len(frames))]

    assert [f.seq for f in in_order] == list(range(len(frames)))  # frame order, none missing
    assert all(f.result is not None and f.result.status is Status.ok for f in in_order)
    results = await wait_for_results(redis_url, ids, timeout_s=240)
    assert set(results) == set(ids), workers.logs()
    boxes = 0
    for n, request_id in enumerate(ids):
        result = results[request_id]
        assert result.status is Status.ok, result
        boxes += check_answer(request_id, scenes[n % len(scenes)], result.outputs, direct)
    assert boxes >= 2 * len(ids)  # several boxes an image, each classified
    framed = sum(len(f.result.outputs["detections"]) for f in in_order if f.result is not None)
    sent = (await metrics(detector_worker))["conveyor_chain_children_sent_total"]
    joined = (await metrics(reader_worker))["conveyor_chain_parents_answered_total"]
    assert sent == boxes + framed  # no fault: each crop sent once
    answers = [*results.values(), *(f.result for f in in_order if f.result is not None)]
    assert joined == sum(1 for r in answers if r.outputs["pipeline"]["children"])
    replies = await read_topic(
        kafka_bootstrap, topics_for(model_name).results, expect=1040, timeout_s=60
    )
    frame_ids = [frame_request_id(stream, seq) for seq in range(len(frames))]
    assert sorted(r.key.decode() for r in replies) == sorted(ids + frame_ids)  # one answer each
    framed_ids = set(frame_ids)
    assert len({r.partition for r in replies if r.key.decode() in framed_ids}) == 1  # a stream
    async with aioredis.Redis.from_url(redis_url) as client:  # no box answered on its own
        assert not await client.exists(*(result_key(child_id(i, 0)) for i in ids[:50]))


@pytest.mark.timeout(420)
async def test_workers_killed_mid_pipeline_lose_nothing_and_change_no_answer(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
    direct: tuple[ModelRunner, ModelRunner],
) -> None:
    classifier = f"{model_name}c"
    await made(client_settings, drop_topics, 4, model_name, classifier)
    records, ids = requests(scenes, 800, model_name, ContentType.PNG)
    first = start_pair(workers, classifier)
    second = start_pair(workers, classifier)
    for worker in (*first, *second):
        await worker.until_serving()
    seen: dict[str, bytes] = {}
    watching = asyncio.create_task(watch(redis_url, ids, seen))
    try:
        await produce(kafka_bootstrap, topics_for(model_name).requests, records)
        await until_answered(redis_url, ids, 100, timeout_s=120)
        first[1].kill()  # a detector, with crops of its batches in flight
        await until_answered(redis_url, ids, 300, timeout_s=180)
        first[0].kill()  # a classifier, while it answers crops
        results = await wait_for_results(redis_url, ids, timeout_s=300)
    finally:
        watching.cancel()
    assert set(results) == set(ids), workers.logs()  # lost 0
    async with aioredis.Redis.from_url(redis_url) as client:
        final = await client.mget([result_key(i) for i in ids])
    changed = [i for i, value in zip(ids, final, strict=True) if i in seen and seen[i] != value]
    assert not changed, changed[:5]  # no answer changed after a caller could read it
    for n, request_id in enumerate(ids):
        value = final[n]
        assert isinstance(value, bytes)
        outputs = orjson.loads(value)["outputs"]
        check_answer(request_id, scenes[n % len(scenes)], outputs, direct)


async def watch(redis_url: str, ids: Sequence[str], seen: dict[str, bytes]) -> None:
    """Keep the first value each id's result had, as a caller polling it would read it."""
    keys = [result_key(i) for i in ids]
    async with aioredis.Redis.from_url(redis_url) as client:
        while True:
            for request_id, value in zip(ids, await client.mget(keys), strict=True):
                if isinstance(value, bytes):
                    seen.setdefault(request_id, value)
            await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_exactly_once_workers_send_the_crops_in_the_parents_transaction(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
    direct: tuple[ModelRunner, ModelRunner],
) -> None:
    classifier = f"{model_name}c"
    await made(client_settings, drop_topics, 2, model_name, classifier)
    records, ids = requests(scenes, 200, model_name, ContentType.PNG)
    workers.start("--model-name", classifier, "--delivery", "exactly-once", model="digits")
    workers.start(
        "--then", classifier, "--then-options", THEN, "--delivery", "exactly-once",
        model=DETECTOR,
    )  # fmt: skip
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=200)
    # The classifier reads committed records only: every crop's transaction committed.
    assert set(results) == set(ids), workers.logs()
    for n, request_id in enumerate(ids):
        check_answer(request_id, scenes[n % len(scenes)], results[request_id].outputs, direct)


@pytest.mark.timeout(300)
async def test_crops_come_from_the_images_the_batch_decoder_made(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
    direct: tuple[ModelRunner, ModelRunner],
) -> None:
    """JPEGs decoded where the detector runs (``--decode gpu``: its batch decoder, here on
    the CPU), whose items keep the images it made for the crops (tests/unit/test_runner.py
    and test_inference.py check that they do): every box is answered as the two models
    answer the same crops directly."""
    classifier = f"{model_name}c"
    await made(client_settings, drop_topics, 2, model_name, classifier)
    jpegs = []
    for scene in scenes:
        buffer = io.BytesIO()
        Image.open(io.BytesIO(scene)).convert("RGB").save(buffer, format="JPEG", quality=95)
        jpegs.append(buffer.getvalue())
    records, ids = requests(jpegs, 120, model_name, ContentType.JPEG)
    workers.start("--model-name", classifier, model="digits")
    workers.start("--then", classifier, "--then-options", THEN, "--decode", "gpu", model=DETECTOR)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=240)
    assert set(results) == set(ids), workers.logs()
    boxes = 0
    for n, request_id in enumerate(ids):
        result = results[request_id]
        assert result.status is Status.ok, result
        payload = jpegs[n % len(jpegs)]
        boxes += check_answer(request_id, payload, result.outputs, direct, ContentType.JPEG)
    assert boxes >= len(ids)


@pytest.mark.timeout(300)
async def test_a_chain_of_three_models_nests_each_stage_in_one_answer(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
    direct: tuple[ModelRunner, ModelRunner],
) -> None:
    """The detector, then the detector again on each of its crops, then the classifier
    on each box found in a crop: one answer, each stage's answers inside the last's."""
    middle, last = f"{model_name}m", f"{model_name}c"
    await made(client_settings, drop_topics, 2, model_name, middle, last)
    records, ids = requests(scenes, 150, model_name, ContentType.PNG)
    workers.start("--model-name", last, model="digits")
    workers.start("--model-name", middle, "--then", last, "--then-options", THEN, model=DETECTOR)
    workers.start("--then", middle, "--then-options", THEN, model=DETECTOR)
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=240)
    assert set(results) == set(ids), workers.logs()
    nested = 0
    for n, request_id in enumerate(ids):
        outputs = results[request_id].outputs
        payload = scenes[n % len(scenes)]
        served = outputs["detections"]
        crops = cut(payload, ContentType.PNG, [d["box"] for d in served], MARGIN, **CROP_LIMITS)
        for index, (found, crop) in enumerate(zip(served, crops, strict=True)):
            then = found["next"]
            assert then["status"] == "ok", then
            assert then["model"] == middle
            # The middle stage answered its crop as the two models would, directly.
            nested += check_answer(
                child_id(request_id, index), crop.data, then["outputs"], direct, crop.content_type
            )
    assert nested > 0  # boxes found inside crops, each classified


@pytest.mark.timeout(300)
async def test_a_parent_whose_children_are_not_answered_by_its_deadline_is_answered_then(
    client_settings: ClientSettings,
    drop_topics: list[str],
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    scenes: list[bytes],
) -> None:
    """The next model is down: each parent is answered just after its deadline, every
    box ``expired``; its children, answered once the next model is back, change nothing."""
    classifier = f"{model_name}c"
    await made(client_settings, drop_topics, 2, model_name, classifier)
    detector = workers.start("--then", classifier, "--then-options", THEN, model=DETECTOR)
    await detector.until_serving()
    deadline = datetime.now(UTC) + timedelta(seconds=4)
    ids = [f"{model_name}-{n}" for n in range(20)]
    records = [
        encode_request(
            scenes[n], request_id=i, content_type=ContentType.PNG, source="t", deadline=deadline
        )
        for n, i in enumerate(ids)
    ]
    await produce(kafka_bootstrap, topics_for(model_name).requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=60)
    assert set(results) == set(ids), workers.logs()
    with_boxes = 0
    for request_id in ids:
        outputs = results[request_id].outputs
        found = outputs["detections"]
        assert [d["next"]["status"] for d in found] == ["expired"] * len(found)
        assert outputs["pipeline"]["failed"] == list(range(len(found)))
        with_boxes += bool(found)
    assert with_boxes > 0
    async with aioredis.Redis.from_url(redis_url) as client:
        before = await client.mget([result_key(i) for i in ids])
    reader = workers.start("--model-name", classifier, model="digits")  # back, late
    await reader.until_serving()

    async def joined() -> float:
        return (await metrics(reader)).get("conveyor_chain_parents_answered_total", 0.0)

    async with asyncio.timeout(60):
        while await joined() < with_boxes:  # its expired answers complete every join
            await asyncio.sleep(0.5)
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await client.mget([result_key(i) for i in ids]) == before  # nothing changed


@pytest.mark.timeout(120)
async def test_a_next_model_without_its_topic_stops_the_worker_saying_what_to_create(
    client_settings: ClientSettings, drop_topics: list[str], model_name: str, workers: Fleet
) -> None:
    await made(client_settings, drop_topics, 1, model_name)
    worker = workers.start("--then", f"{model_name}x", model=DETECTOR)
    assert await worker.exited(60) == 3
    assert f"create it with `conveyor topics create --model {model_name}x`" in worker.log()
