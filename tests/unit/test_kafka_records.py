"""The tolerant reader of fetched record batches, on batches built byte by byte."""

from __future__ import annotations

import gzip
import struct

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kafka.records import (
    REPAIRED,
    BatchRecord,
    TolerantMemoryRecords,
    install,
    parse_batch,
)

Headers = list[tuple[str, bytes | None]]
_PLACEHOLDER = "\x01\x02"  # replaced by b"\xff\xfe" after the batch is built
_CRC_FROM = 21  # the CRC covers the batch from its attributes field on
_ATTRIBUTES_AT = 21


def build(
    records: list[tuple[bytes | None, bytes | None, Headers]], base_offset: int = 0
) -> bytearray:
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 24)
    for delta, (key, value, headers) in enumerate(records):
        assert builder.append(delta, 1_700_000_000_000 + delta, key, value, headers) is not None
    raw = bytearray(builder.build())
    struct.pack_into(">q", raw, 0, base_offset)
    return raw


def with_bad_names(raw: bytearray) -> bytearray:
    """Turn every placeholder header name into the non-UTF-8 bytes ff fe; fix the CRC."""
    patched = bytearray(raw.replace(_PLACEHOLDER.encode(), b"\xff\xfe"))
    struct.pack_into(">I", patched, 17, calc_crc32c(bytes(patched[_CRC_FROM:])))
    return patched


def gzipped(raw: bytearray) -> bytearray:
    """The same batch with its records compressed with gzip (codec 1)."""
    header, body = raw[:61], gzip.compress(bytes(raw[61:]))
    out = bytearray(header) + body
    struct.pack_into(">i", out, 8, len(out) - 12)
    attributes = struct.unpack_from(">h", out, _ATTRIBUTES_AT)[0] | 1
    struct.pack_into(">h", out, _ATTRIBUTES_AT, attributes)
    struct.pack_into(">I", out, 17, calc_crc32c(bytes(out[_CRC_FROM:])))
    return out


def read_all(data: bytes) -> list[BatchRecord]:
    records = TolerantMemoryRecords(data)
    out: list[BatchRecord] = []
    while records.has_next():
        batch = records.next_batch()
        assert batch.validate_crc()
        out.extend(batch)
    return out


def repaired(record: BatchRecord) -> bool:
    """Whether the reader marked ``record`` as read leniently."""
    return record.checksum == REPAIRED


MIXED: list[tuple[bytes | None, bytes | None, Headers]] = [
    (b"k0", b"good-0", [("ce_id", b"a")]),
    (b"k1", b"bad-1", [(_PLACEHOLDER, b"v"), ("ce_id", b"b")]),
    (None, b"good-2", [("x", None)]),
    (b"\xff", None, []),
]


def test_the_fast_parser_refuses_what_the_tolerant_reader_reads() -> None:
    data = bytes(with_bad_names(build(MIXED)))
    fast = MemoryRecords(data).next_batch()
    with pytest.raises(UnicodeDecodeError):
        list(fast)
    records = read_all(data)
    assert [r.offset for r in records] == [0, 1, 2, 3]
    assert [r.value for r in records] == [b"good-0", b"bad-1", b"good-2", None]
    assert [repaired(r) for r in records] == [False, True, False, False]
    bad = records[1]
    name = bad.headers[0][0]
    assert name.encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert bad.headers[1] == ("ce_id", b"b")
    assert bad.checksum == REPAIRED


def test_compressed_batches_are_read_leniently_too() -> None:
    data = bytes(gzipped(with_bad_names(build(MIXED, base_offset=40))))
    records = read_all(data)
    assert [r.offset for r in records] == [40, 41, 42, 43]
    assert [repaired(r) for r in records] == [False, True, False, False]


def test_later_batches_of_the_same_fetch_are_unaffected() -> None:
    first = with_bad_names(build(MIXED[:2], base_offset=0))
    second = build([(b"k", b"after", [("h", b"1")])], base_offset=2)
    records = read_all(bytes(first + second))
    assert [r.value for r in records] == [b"good-0", b"bad-1", b"after"]
    assert repaired(records[1])
    assert not repaired(records[2])


def test_a_truncated_batch_at_the_end_of_a_fetch_is_left_for_the_next_fetch() -> None:
    whole = build(MIXED[:1])
    partial = build(MIXED[2:3], base_offset=1)[:-5]
    assert [r.offset for r in read_all(bytes(whole + partial))] == [0]


def test_a_malformed_batch_raises_value_error() -> None:
    raw = build(MIXED[:1])
    with pytest.raises(ValueError, match="malformed"):
        parse_batch(bytes(raw[:-3]))


names = st.text(min_size=0, max_size=8)
blobs = st.none() | st.binary(max_size=32)
record_st = st.tuples(blobs, blobs, st.lists(st.tuples(names, blobs), max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.lists(record_st, min_size=1, max_size=12), st.integers(0, 2**40))
def test_lenient_reading_equals_aiokafka_on_valid_batches(
    records: list[tuple[bytes | None, bytes | None, Headers]], base: int
) -> None:
    raw = bytes(build(records, base_offset=base))
    fast = list(MemoryRecords(raw).next_batch())
    lenient = parse_batch(raw)
    assert [
        (r.offset, r.timestamp, r.timestamp_type, r.key, r.value, list(r.headers)) for r in fast
    ] == [(r.offset, r.timestamp, r.timestamp_type, r.key, r.value, r.headers) for r in lenient]
    assert not any(repaired(r) for r in lenient)


def test_install_is_idempotent_and_checks_the_hook() -> None:
    import aiokafka.consumer.fetcher as fetcher

    install()
    install()
    assert fetcher.MemoryRecords is TolerantMemoryRecords


def test_checksums_are_checked_and_a_corrupt_batch_fails_them() -> None:
    raw = build(MIXED)
    batch = TolerantMemoryRecords(bytes(raw)).next_batch()
    assert batch.validate_crc()
    corrupt = bytearray(raw)
    corrupt[-1] ^= 0xFF
    assert not TolerantMemoryRecords(bytes(corrupt)).next_batch().validate_crc()


def test_what_the_consumer_hands_out_has_what_the_pipeline_reads() -> None:
    """The pipeline reads records as ``workers.types.Record``. aiokafka has no type
    information for mypy to check that against, so this checks at run time that the
    ``ConsumerRecord`` aiokafka's fetcher makes, from records read fast or leniently,
    has every member of it with a value of the declared type."""
    from types import SimpleNamespace
    from typing import get_type_hints

    from aiokafka.consumer.fetcher import PartitionRecords
    from aiokafka.structs import ConsumerRecord, TopicPartition

    from workers.types import Record

    members = {name for name, value in vars(Record).items() if isinstance(value, property)}
    assert members == {
        "topic",
        "partition",
        "offset",
        "timestamp",
        "key",
        "value",
        "headers",
        "checksum",
    }
    assert members <= set(get_type_hints(ConsumerRecord))
    fetched = read_all(bytes(with_bad_names(build(MIXED))))
    assert [repaired(r) for r in fetched] == [False, True, False, False]  # both kinds
    fetcher = SimpleNamespace(_key_deserializer=None, _value_deserializer=None)
    for record in fetched:
        made = PartitionRecords._consumer_record(fetcher, TopicPartition("requests", 3), record)
        assert isinstance(made, ConsumerRecord)
        assert (made.topic, made.partition) == ("requests", 3)
        assert isinstance(made.offset, int)
        assert isinstance(made.timestamp, int)
        assert made.key is None or isinstance(made.key, bytes)
        assert made.value is None or isinstance(made.value, bytes)
        assert all(
            isinstance(n, str) and (v is None or isinstance(v, bytes)) for n, v in made.headers
        )
        assert made.checksum in (None, REPAIRED)
