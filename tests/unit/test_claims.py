"""Claims (payloads by reference) over fake stores: the rules, the order, the budget, outages.

The stores here are fakes of the ``PayloadStore`` port (pure logic under test);
the Redis and S3 adapters are tested against the real servers in
tests/integration/test_claims.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from schemas import DataRef, ErrorCode, parse_dataref
from tests.fakes import DATA_PREFIX as PREFIX
from tests.fakes import FakeStore, Prepared, claims_over, request_item
from workers.intake.payload_stores import Fault
from workers.observe.metrics import Metrics
from workers.types import Refusal


def codes(refused: list[Refusal]) -> dict[str | None, ErrorCode]:
    return {r.request_id: r.code for r in refused}


async def test_referenced_payloads_are_read_and_prepared_with_inline_ones_in_order() -> None:
    store = FakeStore({PREFIX + "b": b"bee", PREFIX + "d": b"dee"})
    items = [
        request_item("a"),
        request_item("b", f"redis:{PREFIX}b"),
        request_item("c"),
        request_item("d", f"redis:{PREFIX}d"),
    ]
    prepare = Prepared()
    ready, refused = await claims_over({"redis": store}).resolve(items, prepare)
    assert refused == []
    assert [i.meta.id for i in ready] == ["a", "b", "c", "d"]
    payloads = dict(pair for call in prepare.calls for pair in call)
    assert payloads == {"a": b"inline", "b": b"bee", "c": b"inline", "d": b"dee"}
    assert store.reads == [[PREFIX + "b", PREFIX + "d"]]  # one read for both


async def test_missing_expired_too_large_and_denied_references_get_their_codes() -> None:
    past = datetime.now(UTC) - timedelta(seconds=1)
    future = datetime.now(UTC) + timedelta(hours=1)
    store = FakeStore({PREFIX + "big": b"x" * 1001, PREFIX + "fits": b"x" * 1000})
    items = [
        request_item("missing", f"redis:{PREFIX}nothing"),
        request_item("kept", f"redis:{PREFIX}nothing", expires=future),
        request_item("expired", f"redis:{PREFIX}nothing", expires=past),
        request_item("big", f"redis:{PREFIX}big"),
        request_item("fits", f"redis:{PREFIX}fits"),
        request_item("prefix", "redis:other:key"),
        request_item("bucket", "s3://elsewhere/key"),
    ]
    ready, refused = await claims_over({"redis": store}).resolve(items, Prepared())
    assert [i.meta.id for i in ready] == ["fits"]
    assert codes(refused) == {
        "missing": ErrorCode.dataref_missing,
        "kept": ErrorCode.dataref_missing,
        "expired": ErrorCode.dataref_expired,
        "big": ErrorCode.dataref_too_large,
        "prefix": ErrorCode.dataref_denied,
        "bucket": ErrorCode.dataref_denied,  # no S3 store configured at all
    }
    by_id = {r.request_id: r for r in refused}
    assert not by_id["expired"].dead_letter  # nothing wrong with the record
    assert by_id["missing"].dead_letter
    assert "1001 bytes" in by_id["big"].message
    assert "1000" in by_id["big"].message
    assert store.reads == [[PREFIX + "fits"]]  # refused objects are never read


async def test_a_bucket_outside_the_list_is_denied_when_s3_is_configured() -> None:
    s3 = FakeStore({"k": b"payload"})
    items = [request_item("in", "s3://payloads/k"), request_item("out", "s3://other-bucket/k")]
    ready, refused = await claims_over({"redis": FakeStore(), "s3": s3}).resolve(items, Prepared())
    assert [i.meta.id for i in ready] == ["in"]
    assert codes(refused) == {"out": ErrorCode.dataref_denied}
    assert "other-bucket" in refused[0].message


async def test_reads_are_grouped_so_held_bytes_stay_within_the_budget() -> None:
    store = FakeStore({f"{PREFIX}{n}": bytes(40) for n in range(7)})
    resolver = claims_over({"redis": store}, budget_bytes=100)
    store.budget = resolver.budget
    items = [request_item(str(n), f"redis:{PREFIX}{n}") for n in range(7)]
    ready, refused = await resolver.resolve(items, Prepared())
    assert len(ready) == 7
    assert refused == []
    assert [len(keys) for keys in store.reads] == [2, 2, 2, 1]
    assert store.peak_held == 80
    assert resolver.budget.used == 0


async def test_an_object_larger_than_the_budget_is_read_alone() -> None:
    store = FakeStore({PREFIX + "huge": bytes(500), PREFIX + "small": bytes(10)})
    resolver = claims_over({"redis": store}, budget_bytes=100)
    store.budget = resolver.budget
    items = [
        request_item("small", f"redis:{PREFIX}small"),
        request_item("huge", f"redis:{PREFIX}huge"),
    ]
    ready, _ = await resolver.resolve(items, Prepared())
    assert [i.meta.id for i in ready] == ["small", "huge"]
    assert store.reads == [[PREFIX + "small"], [PREFIX + "huge"]]
    assert store.peak_held == 100  # capped at the whole budget


async def test_concurrent_chunks_share_the_budget_without_deadlock() -> None:
    store = FakeStore({f"{PREFIX}{n}": bytes(60) for n in range(6)})
    resolver = claims_over({"redis": store}, budget_bytes=100)
    store.budget = resolver.budget
    chunks = [[request_item(f"{c}-{n}", f"redis:{PREFIX}{n}") for n in range(3)] for c in range(4)]
    results = await asyncio.wait_for(
        asyncio.gather(*(resolver.resolve(chunk, Prepared()) for chunk in chunks)), 5
    )
    assert all(len(ready) == 3 for ready, _ in results)
    assert store.peak_held <= 100


async def test_an_outage_is_retried_until_the_store_answers() -> None:
    store = FakeStore({PREFIX + "a": b"payload"}, outages=3)
    metrics = Metrics("t")
    ready, refused = await claims_over({"redis": store}, metrics=metrics).resolve(
        [request_item("a", f"redis:{PREFIX}a")], Prepared()
    )
    assert [i.meta.id for i in ready] == ["a"]
    assert refused == []
    assert b'conveyor_dataref_retries_total{model="t",store="redis"} 3.0' in metrics.render()


async def test_an_object_deleted_between_size_and_read_is_missing() -> None:
    class Vanishing(FakeStore):
        async def read(self, refs: Sequence[DataRef], max_bytes: int) -> list[bytes | Fault | None]:
            return [None for _ in refs]

    store = Vanishing({PREFIX + "a": b"payload"})
    ready, refused = await claims_over({"redis": store}).resolve(
        [request_item("a", f"redis:{PREFIX}a")], Prepared()
    )
    assert ready == []
    assert codes(refused) == {"a": ErrorCode.dataref_missing}


async def test_a_bug_in_a_store_fails_the_chunk_with_internal_errors_not_the_worker() -> None:
    class Broken(FakeStore):
        async def sizes(self, refs: Sequence[DataRef]) -> list[int | Fault | None]:
            raise RuntimeError("bug")

    items = [request_item("a", f"redis:{PREFIX}a"), request_item("b")]
    ready, refused = await claims_over({"redis": Broken()}).resolve(items, Prepared())
    assert ready == []
    assert codes(refused) == {"a": ErrorCode.internal, "b": ErrorCode.internal}


@pytest.mark.parametrize(
    ("uri", "store", "bucket", "key"),
    [
        ("redis:conveyor:data:id1", "redis", "", "conveyor:data:id1"),
        ("REDIS:k%20ey", "redis", "", "k ey"),
        ("s3://my.bucket-1/a/b%2Fc.png", "s3", "my.bucket-1", "a/b/c.png"),
    ],
)
def test_references_parse(uri: str, store: str, bucket: str, key: str) -> None:
    assert parse_dataref(uri) == DataRef(uri, store, bucket, key)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "uri",
    [
        "redis:",
        "redis:a b",
        "redis:%zz",
        "redis:%ff",  # not UTF-8 once decoded
        "s3://Bucket/key",
        "s3://bucket",
        "s3://bucket/",
        "s3:/bucket/key",
        "http://host/key",
        "conveyor:data:id1",
        "redis:" + "k" * 1025,
    ],
)
def test_malformed_references_are_refused(uri: str) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        parse_dataref(uri)
