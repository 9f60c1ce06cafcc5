"""Payloads by reference through the pipeline: served in partition order among inline
ones, refused by a worker without stores.
"""

from __future__ import annotations

from schemas import ContentType, ErrorCode, decode_result, encode_request
from tests.fakes import TOPIC, FakeRecord, FakeSource, FakeStore, GatedEcho
from tests.unit.pipeline.harness import make, records, run_until


def referenced(partition: int, first: int, count: int) -> list[FakeRecord]:
    """Requests whose one-byte payloads are stored as conveyor:data:<id>."""
    out = []
    for n in range(first, first + count):
        rid = f"p{partition}-{n}"
        record = encode_request(
            b"",
            request_id=rid,
            content_type=ContentType.TEXT,
            source="t",
            dataref=f"redis:conveyor:data:{rid}",
        )
        out.append(FakeRecord(TOPIC, partition, n, 0, record.key, record.value, record.headers))
    return out


async def test_referenced_payloads_are_served_in_partition_order_among_inline_ones() -> None:
    mixed = records(0, 4) + referenced(0, 4, 4) + records(0, 4, first=8)
    stored = {f"conveyor:data:p0-{n}": bytes([100 + n]) for n in range(4, 8)}
    del stored["conveyor:data:p0-6"]  # one of them was never stored
    source = FakeSource({0: mixed})
    pipeline, sink = make(source, GatedEcho(), stores={"redis": FakeStore(stored)})
    await run_until(pipeline, lambda: len(sink.stored) == 12)
    outputs = {i: decode_result(v).outputs for i, v in sink.stored.items()}
    assert [outputs[f"p0-{n}"] for n in (4, 5, 7)] == [104, 105, 107]  # the stored bytes
    error = decode_result(sink.stored["p0-6"]).error
    assert error is not None
    assert error.code == ErrorCode.dataref_missing
    ok = [i for i in sink.published_ids() if i != "p0-6"]
    assert ok == sorted(ok, key=lambda i: int(i.split("-")[1]))
    assert source.committed == {0: 12}


async def test_a_worker_without_stores_refuses_references() -> None:
    source = FakeSource({0: referenced(0, 0, 2)})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 2)
    assert {decode_result(v).error.code for v in sink.stored.values()} == {  # type: ignore[union-attr]
        ErrorCode.dataref_denied
    }
