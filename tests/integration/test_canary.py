"""A canary on the real broker and Redis: the share it answers, widened while requests wait.

A primary worker serves version v1 and a canary worker (``--canary``) v2 of the same
model, each in its own consumer group on the same request topic, delivering at least
once or exactly once (positions, the share with them, then committed by transactions).
``conveyor canary`` gives the canary 10% of the requests, then, with thousands of them
still waiting, 50% of those sent after; then the canary is killed mid-backlog and
started again (its records redelivered, its share read back from its commits). Every request
is answered once, by the version its bucket and the share at its offset give it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    count_results,
    produce,
    read_results,
    tally,
    until,
    until_all_ready,
    until_answered,
)
from schemas import topics_for
from tests.harness import metrics
from tests.versioned import (
    SPEC,
    RequestLog,
    computed_by,
    conveyor,
    json_lines,
    versioned_requests,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 4
PER_SHARE = 10_000
# Slow enough that requests wait in the topic when the share is widened and when the
# canary is killed: 1,600 and 800 requests/s at most.
PRIMARY = {"version": "v1", "drift": 0, "slow_ms": 20}
CANARY = {"version": "v2", "drift": 1, "slow_ms": 20}
DRIFTS = {"v1": 0, "v2": 1}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_the_canary_answers_its_share_and_widening_keeps_one_answer_per_id(
    delivery: str,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    drop_topics: list[str],
) -> None:
    topics = topics_for(model_name)
    drop_topics.append(model_name)
    await create_model_topics(client_settings, model_name, partitions=PARTITIONS)
    connection = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    both = ["--delivery", delivery]
    # A session long enough that the group keeps the primary while it is frozen (below).
    session = ("--session-timeout-ms", "60000")
    primary = workers.start(
        *both, *session, "--max-batch-size", "32", "--model-options", json.dumps(PRIMARY),
        model=SPEC,
    )  # fmt: skip

    status, out, err = await conveyor("canary", *connection, "--model", model_name, "--share", "10")
    assert status == 0, err
    [placed] = json_lines(out)
    assert placed["share"] == 0.1
    assert len(placed["markers"]) == len(placed["placed"]) == PARTITIONS  # the group's start
    assert placed["canary_workers"] == 0
    assert "no canary worker runs yet" in err

    flags = [*both, "--max-batch-size", "16", "--model-options", json.dumps(CANARY), "--canary"]
    canary = workers.start(*flags, model=SPEC)
    await until_all_ready([primary, canary], 180)
    first, first_ids = versioned_requests(PER_SHARE, f"{model_name}-a")
    await produce(kafka_bootstrap, topics.requests, first)
    await until_answered(redis_url, first_ids, PER_SHARE // 5)

    # Widened while most of the first requests still wait in the topic: they keep 10%.
    # The primary is frozen meanwhile, so they still wait however long the command takes
    # to start (on a busy machine it once outlasted the rest of the backlog).
    primary.pause()
    try:
        status, out, err = await conveyor(
            "canary", *connection, "--model", model_name, "--share", "50"
        )
    finally:
        primary.resume()
    assert status == 0, err
    [widened] = json_lines(out)
    assert widened["placed"] == []  # the group has its positions: only markers
    assert widened["canary_workers"] == 1
    waiting = PER_SHARE - await count_results(redis_url, first_ids)
    assert waiting > 0  # the widening landed behind requests not answered yet
    second, second_ids = versioned_requests(PER_SHARE, f"{model_name}-b")
    ids = first_ids + second_ids
    await produce(kafka_bootstrap, topics.requests, second)

    await until_answered(redis_url, second_ids, PER_SHARE // 4)
    canary.kill()  # mid-backlog: what it fetched and did not commit comes again
    left = 2 * PER_SHARE - await count_results(redis_url, ids)
    again = workers.start(*flags, model=SPEC)

    counted = await tally(kafka_bootstrap, redis_url, topics.results, ids, timeout_s=300)
    assert counted.lost == 0, workers.logs()[-5000:]
    assert counted.duplicate_visible == 0

    log = await RequestLog.read(kafka_bootstrap, topics.requests, len(ids) + 2 * PARTITIONS)
    results = await read_results(redis_url, ids)
    payloads = {r.key.decode(): r.value for r in first + second}
    expected = {i: "v2" if log.canary_answers(i) else "v1" for i in ids}
    wrong = [i for i in ids if results[i].model_version != expected[i]]
    assert not wrong, f"{len(wrong)} answered by the other version, e.g. {wrong[:5]}"
    assert all(computed_by(results[i], payloads[i], DRIFTS) for i in ids)

    first_share = sum(expected[i] == "v2" for i in first_ids) / PER_SHARE
    second_share = sum(expected[i] == "v2" for i in second_ids) / PER_SHARE
    assert abs(first_share - 0.10) <= 0.02, first_share
    assert abs(second_share - 0.50) <= 0.02, second_share

    # The primary never restarted: it computed each of its requests once and no other.
    counts = await metrics(primary)
    assert counts["conveyor_requests_total"] == sum(v == "v1" for v in expected.values())
    assert counts["conveyor_redeliveries_total"] == 0
    restarted = await metrics(again)
    assert restarted["conveyor_requests_total"] > 0  # it was killed with work left
    assert restarted["conveyor_canary_share"] == 0.5

    where: list[dict[str, Any]] = []

    async def both_groups_caught_up() -> bool:
        status, out, err = await conveyor("canary", *connection, "--model", model_name)
        assert status == 0, err
        where[:] = json_lines(out)
        return all(p["behind"] == 0 for p in where)

    await until(both_groups_caught_up, "both groups commit their last positions", 60)
    assert len(where) == 2 * PARTITIONS
    assert {p["share"] for p in where} == {0.5}  # the share at both groups' positions
    print(
        f"{delivery}: canary shares answered by v2: {first_share:.2%} of the first {PER_SHARE:,} "
        f"requests (10% asked), {second_share:.2%} of the next {PER_SHARE:,} (50% asked); "
        f"{waiting:,} requests unanswered when the share was widened, {left:,} when the canary "
        f"was killed; {counted.redelivered} redelivered"
    )
