"""A shadow on the real broker: every request answered by v2 on its own topic, none by Redis.

A primary worker serves v1; a shadow worker (``--shadow``) serves v2 of the same model
in its own consumer group, given a Redis URL where nothing listens: it never needs
Redis. Its results equal a direct run of v2 on the same payloads; callers (Redis,
the reply topic, the dead-letter topic) see v1 alone; ``conveyor compare`` joins the
two and reports the agreement a direct run of both versions predicts.
"""

from __future__ import annotations

import json

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    free_port,
    produce,
    read_results,
    read_topic,
    tally,
    until_all_ready,
)
from schemas import OutgoingRecord, Result, decode_result, topics_for
from tests.versioned import SPEC, answer, conveyor, json_lines, versioned_requests

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 2000
REFUSED = 20  # requests of a media type no worker takes: an error result and a dead letter
GIF = b"image/gif"
SHADOW_DRIFT = 1
PRIMARY = {"version": "v1", "drift": 0}
SHADOW = {"version": "v2", "drift": SHADOW_DRIFT}


@pytest.mark.timeout(300)
async def test_a_shadow_answers_every_request_on_its_own_topic_and_callers_never_see_it(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    drop_topics: list[str],
) -> None:
    topics = topics_for(model_name)
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=3, shadow=True)
    primary = workers.start("--model-options", json.dumps(PRIMARY), model=SPEC)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: the shadow never asks
    shadow = workers.start(
        "--model-options", json.dumps(SHADOW), "--shadow", model=SPEC, redis_url=nowhere
    )
    await until_all_ready([primary, shadow], 180)

    records, ids = versioned_requests(REQUESTS, model_name)
    gif, refused_ids = versioned_requests(REFUSED, f"{model_name}-gif")
    refused = [
        OutgoingRecord(
            r.key, r.value, [(n, GIF if n == "content-type" else v) for n, v in r.headers]
        )
        for r in gif
    ]
    await produce(kafka_bootstrap, topics.requests, records + refused)
    everything = ids + refused_ids
    counted = await tally(kafka_bootstrap, redis_url, topics.results, everything, timeout_s=120)
    assert counted.lost == 0, workers.logs()[-5000:]

    # The shadow answered every request, v2 as a direct run computes it, on its topic.
    shadowed: dict[str, Result] = {}
    for record in await read_topic(kafka_bootstrap, topics.shadow_results, len(everything), 120):
        result = decode_result(record.value)
        shadowed.setdefault(result.id, result)
    assert set(shadowed) == set(everything)
    payloads = {r.key.decode(): r.value for r in records}
    assert {r.model_version for r in shadowed.values()} == {"v2"}
    assert all(shadowed[i].outputs == answer(payloads[i], SHADOW_DRIFT) for i in ids)

    # Callers see v1 alone: in Redis, on the reply topic and in the dead letters.
    in_redis = await read_results(redis_url, everything)
    assert {r.model_version for r in in_redis.values()} == {"v1"}
    codes = {i: in_redis[i].error for i in refused_ids}
    assert all(code is not None for code in codes.values())
    assert all(shadowed[i].error == codes[i] for i in refused_ids)  # refused alike
    replies = await read_topic(kafka_bootstrap, topics.results, len(everything), 60)
    assert {decode_result(r.value).model_version for r in replies} == {"v1"}
    dead = await read_topic(kafka_bootstrap, topics.dlq, REFUSED, 30)
    assert len(dead) == REFUSED  # the primary's copies only
    assert all(dict(r.headers)["content-type"] == GIF for r in dead)

    connection = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    status, out, err = await conveyor("compare", *connection, "--model", model_name, "--json")
    assert status == 0, err
    [found] = json_lines(out)
    same_top = sum(
        answer(payloads[i], 0)[0]["index"] == answer(payloads[i], 1)[0]["index"] for i in ids
    )
    assert found["joined"] == len(everything)
    assert found["shadow_only"] == 0
    assert found["primary_versions"] == {"v1": len(everything)}
    assert found["shadow_versions"] == {"v2": len(everything)}
    assert found["status"]["agreed"] == len(everything)
    assert found["top1"] == {"compared": REQUESTS, "agreed": same_top, "rate": same_top / REQUESTS}
    assert found["latency_ms"]["shadow"]["end_to_end"]["p50"] > 0

    status, text, err = await conveyor("compare", *connection, "--model", model_name)
    assert status == 0, err
    assert f"top-1 class agrees: {same_top:,} of {REQUESTS:,}" in text
    print(text)
