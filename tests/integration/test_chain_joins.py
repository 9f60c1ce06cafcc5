"""A parent's join on the real Redis: what each step writes, and what repeating it, or a
child that does not fit its parent, does (``workers.chain.joins``)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from PIL import Image

from producers.testing import until
from schemas import ContentType, Status, result_key
from schemas.chain import child_of
from schemas.fastpath import FastMeta, ResultEncoder
from tests.fakes import FakeRecord
from workers.chain.joins import Joins
from workers.chain.scripts import OneServer
from workers.config.next_stage import NextStage
from workers.offsets import OffsetTracker
from workers.types import ChildAnswer, Item, Outbox, Parent

FIRST = ResultEncoder("first", "f1", "worker-a")
NEXT = ResultEncoder("next", "n1", "worker-b")


async def _once(what: str, call: Callable[[], Awaitable[Any]]) -> Any:
    return await call()


class Counted:
    """What the joins counted, as the worker's metrics would."""

    def __init__(self) -> None:
        self.sent = self.answered = self.orphans = 0

    def chain(self, sent: int, answered: int, orphans: int) -> None:
        self.sent += sent
        self.answered += answered
        self.orphans += orphans


@pytest.fixture
def counted() -> Counted:
    return Counted()


@pytest.fixture
async def joins(redis_url: str, counted: Counted) -> AsyncIterator[Joins]:
    scripts = OneServer(aioredis.Redis.from_url(redis_url))
    yield Joins(
        scripts,
        FIRST,
        _once,
        stage=NextStage.parse("next", {"min_score": 0.3, "margin": 0.0}, "conveyor"),
        next_partitions=3,
        ttl_s=60,
        max_pixels=10**7,
        max_crop_bytes=10**6,
        max_result_bytes=10**6,
        results_topic="conveyor.first.results",
        worker="worker-a",
        counts=counted,
    )
    await scripts.aclose()


def _png() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _parent(request_id: str, *scores: float) -> Parent:
    found = [
        {"box": [2.0 + 10 * i, 3.0, 9.0 + 10 * i, 20.0], "score": s, "index": 1, "label": "1"}
        for i, s in enumerate(scores)
    ]
    output = {"type": "conveyor.detection.v1", "width": 60, "height": 40, "detections": found}
    meta = FastMeta(request_id, ContentType.PNG, {}, None, None, None, None, None)
    record = FakeRecord("conveyor.first.requests", 1, 7, value=_png())
    span = OffsetTracker[str]().open("p", 0, 0, 1)
    item = Item(record, span, meta, 0.0, None)
    return Parent(item, output, FIRST.encode(request_id, Status.ok, output, None, None))


def _child(parent: str, index: int, count: int, label: str) -> ChildAnswer:
    request_id = f"{parent}:{index}"
    outputs = [{"label": label, "index": int(label), "score": 0.9}]
    document = NEXT.encode(request_id, Status.ok, outputs, None, None)
    return ChildAnswer(request_id, parent, index, count, document, 0)


async def _settled(joins: Joins, **lists: Any) -> Outbox:
    outbox = Outbox(**lists)
    await joins.settle(outbox)
    return outbox


async def test_a_parent_sends_its_chosen_boxes_and_a_redelivery_sends_the_same(
    joins: Joins, uid: str
) -> None:
    parent = f"p-{uid}"
    sent = await _settled(joins, parents=[_parent(parent, 0.9, 0.5, 0.1)])
    assert sent.ids == []  # no result until the children are answered
    assert [child_of(r.headers) for r in sent.requests] == [
        child_of([("ce_parent", parent.encode()), ("ce_index", b"0"), ("ce_count", b"2")]),
        child_of([("ce_parent", parent.encode()), ("ce_index", b"1"), ("ce_count", b"2")]),
    ]
    assert {r.topic for r in sent.requests} == {"conveyor.next.requests"}
    # Run again (a redelivered parent) with another answer: the first run's boxes go out.
    again = await _settled(joins, parents=[_parent(parent, 0.95)])
    assert [(r.key, r.value, r.partition) for r in again.requests] == [
        (r.key, r.value, r.partition) for r in sent.requests
    ]


async def test_the_last_child_writes_the_parent_and_a_repeated_child_keeps_its_first_answer(
    joins: Joins, uid: str, counted: Counted
) -> None:
    parent = f"p-{uid}"
    await _settled(joins, parents=[_parent(parent, 0.9, 0.8)])
    first = await _settled(joins, children=[_child(parent, 0, 2, "3")])
    assert first.ids == []
    repeated = await _settled(joins, children=[_child(parent, 0, 2, "5")])  # redelivered
    assert repeated.ids == []
    done = await _settled(joins, children=[_child(parent, 1, 2, "7")])
    assert done.ids == [parent]
    assert done.reply_to == ["conveyor.first.results"]
    final = orjson.loads(done.values[0])
    assert final["model"] == "first"
    answers = [d["next"]["outputs"][0]["label"] for d in final["outputs"]["detections"]]
    assert answers == ["3", "7"]
    assert final["outputs"]["pipeline"] == {"model": "next", "children": 2, "failed": []}
    # A child redelivered after the parent's result: the same result again (Redis keeps
    # the first; the reply topic may carry it twice, as for any redelivered request).
    late = await _settled(joins, children=[_child(parent, 1, 2, "7")])
    assert late.values == done.values
    assert (counted.sent, counted.answered, counted.orphans) == (2, 2, 0)  # the late one too


@pytest.mark.parametrize(("index", "count"), [(2, 2), (0, 3), (5, 9)])
async def test_a_child_that_does_not_fit_its_join_is_answered_under_its_own_id(
    joins: Joins, uid: str, index: int, count: int, counted: Counted
) -> None:
    parent = f"p-{uid}"
    await _settled(joins, parents=[_parent(parent, 0.9, 0.8)])
    odd = _child(parent, index, count, "4")
    out = await _settled(joins, children=[odd])
    assert out.ids == [odd.request_id]  # not in the join: it cannot complete it
    assert counted.orphans == 1
    assert (await _settled(joins, children=[_child(parent, 0, 2, "1")])).ids == []


async def test_a_parent_already_answered_sends_no_children(
    joins: Joins, uid: str, redis_url: str
) -> None:
    parent = f"p-{uid}"
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set(result_key(parent), b"answered", ex=60)
    out = await _settled(joins, parents=[_parent(parent, 0.9)])
    assert out.requests == []
    assert out.ids == [parent]  # its stored result goes to the reply topic again


async def test_a_parent_without_chosen_boxes_is_answered_at_once(joins: Joins, uid: str) -> None:
    parent = f"p-{uid}"
    out = await _settled(joins, parents=[_parent(parent, 0.1)])
    assert out.requests == []
    assert out.ids == [parent]
    assert orjson.loads(out.values[0])["outputs"]["pipeline"]["children"] == 0


async def test_the_whole_image_child_answers_inside_the_parents_object(
    redis_url: str, uid: str
) -> None:
    client = OneServer(aioredis.Redis.from_url(redis_url))
    stage = NextStage.parse("next", {"crop": "image", "size": 30}, "conveyor")
    whole = Joins(
        client, FIRST, _once, stage=stage, next_partitions=1, ttl_s=60, max_pixels=10**7,
        max_crop_bytes=10**6, max_result_bytes=10**6, results_topic="conveyor.first.results",
        worker="worker-a",
    )  # fmt: skip
    parent = _parent(f"p-{uid}")  # no detections: the image itself goes on
    try:
        sent = await _settled(whole, parents=[parent])
        (request,) = sent.requests
        assert ("content-type", b"application/x-npy") in request.headers
        shape = np.load(io.BytesIO(request.value), allow_pickle=False).shape
        assert shape == (20, 30, 3)  # 60x40, longest side 30
        done = await _settled(whole, children=[_child(f"p-{uid}", 0, 1, "2")])
        final = orjson.loads(done.values[0])
        assert final["outputs"]["next"]["outputs"][0]["label"] == "2"
        assert final["outputs"]["pipeline"]["children"] == 1
    finally:
        await client.aclose()


async def test_a_chain_of_three_answers_once_with_each_stage_nested(joins: Joins, uid: str) -> None:
    """first -> next (itself chained) -> a third model: the middle answer of child
    ``p:0`` is a parent of its own, and its answer, complete, joins ``p``."""
    top = f"p-{uid}"
    await _settled(joins, parents=[_parent(top, 0.9)])  # one child: top:0
    middle = _parent(f"{top}:0", 0.8, 0.7)  # the middle model's answer to top:0
    middle.up = (top, 0, 1)
    sent = await _settled(joins, parents=[middle])
    assert len(sent.requests) == 2  # its own two children go on
    assert sent.ids == []
    assert (await _settled(joins, children=[_child(f"{top}:0", 0, 2, "4")])).ids == []
    done = await _settled(joins, children=[_child(f"{top}:0", 1, 2, "6")])
    assert done.ids == [top]  # the middle join completed, and with it the top one
    final = orjson.loads(done.values[0])
    (found,) = final["outputs"]["detections"]
    inner = found["next"]["outputs"]["detections"]
    assert [d["next"]["outputs"][0]["label"] for d in inner] == ["4", "6"]


async def test_a_parent_is_answered_at_its_deadline_with_the_children_it_has(
    redis_url: str, uid: str
) -> None:
    client = OneServer(aioredis.Redis.from_url(redis_url))
    written: list[Outbox] = []

    async def publish(outbox: Outbox) -> None:
        written.append(outbox)

    timed = Joins(
        client, FIRST, _once, stage=NextStage.parse("next", {"min_score": 0.3}, "conveyor"),
        next_partitions=1, ttl_s=60, max_pixels=10**7, max_crop_bytes=10**6,
        max_result_bytes=10**6, results_topic="conveyor.first.results", worker="worker-a",
        publish=publish,
    )  # fmt: skip
    parent = f"p-{uid}"
    made = _parent(parent, 0.9, 0.8)
    made.item.meta = made.item.meta._replace(deadline=datetime.now(UTC) + timedelta(seconds=1))
    try:
        await _settled(timed, parents=[made])
        await _settled(timed, children=[_child(parent, 0, 2, "3")])
        await until(lambda: bool(written), "the result written at the deadline", 10)
        (outbox,) = written
        assert outbox.ids == [parent]
        final = orjson.loads(outbox.values[0])
        first, second = final["outputs"]["detections"]
        assert first["next"]["status"] == "ok"
        assert second["next"]["status"] == "expired"
        assert second["next"]["error"]["code"] == "expired"
        assert final["outputs"]["pipeline"]["failed"] == [1]
    finally:
        await timed.aclose()
