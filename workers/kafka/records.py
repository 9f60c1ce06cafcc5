"""Reading fetched record batches so that no record a producer can write stops the worker.

aiokafka's record parser decodes header names as strict UTF-8. Kafka itself
does not check them (Java's client decodes them with replacement characters),
so one record with a header name such as ``b"\\xff\\xfe"`` makes ``getmany``
raise ``UnicodeDecodeError`` every time it reaches that record: the worker
exits, its offset is never committed, and every worker of the group that takes
the partition over dies on the same record.

``TolerantMemoryRecords`` stands in for aiokafka's ``MemoryRecords`` in the
fetcher (``install()``). It hands out aiokafka's own fast batches and watches
them: when one raises while its records are read, that whole batch is
parsed again here, in Python, from the batch's raw bytes, with header names
decoded leniently (``surrogateescape``, so the exact bytes can be recovered).
Every record of the batch reaches the consumer, in order; the ones that needed
the lenient reading are marked (``checksum == REPAIRED``) so the worker can refuse
them on purpose: a dead-letter copy and an ``error`` result, then a commit past them.

Why this mechanism rather than another (docs/reliability.md has the long form):
seeking past the bad offset would not help, because Kafka returns whole
batches and aiokafka parses every record of a batch before it skips those
below the position, so the bad record would raise again; seeking past the
whole batch would lose the valid records behind the bad one. Only a second,
lenient reading of the batch keeps its neighbours. The fast path is untouched:
a batch that parses is read by aiokafka's C parser as before, and the Python
reading runs only for batches that fail.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiokafka.consumer.fetcher as _fetcher
from aiokafka import codec
from aiokafka.record.memory_records import MemoryRecords

__all__ = [
    "REPAIRED",
    "BatchRecord",
    "LenientRecord",
    "TolerantMemoryRecords",
    "install",
    "parse_batch",
]

REPAIRED: Final = -0x5EC0DE
"""The ``checksum`` of a record read leniently. ConsumerRecord.checksum is deprecated
and always None for the record format Kafka 3+ stores (v2), so it can carry the mark
from the parser to the worker without another per-record field."""

_LOG_OVERHEAD = 12  # base offset (int64) + batch length (int32): what precedes every batch
_MAGIC_AT = 16  # base offset, length, partition leader epoch, then the magic byte
_V2_HEADER = struct.Struct(">qiibIhiqqqhii")
_CODECS: dict[int, Callable[[Any], bytes]] = {
    1: codec.gzip_decode,
    2: lambda data: codec.snappy_decode(bytes(data)),
    3: lambda data: codec.lz4_decode(bytes(data)),
    4: lambda data: codec.zstd_decode(bytes(data)),
}
_TIMESTAMP_TYPE_MASK = 0x08
_CRC = struct.Struct(">I")
_CRC_AT = 17  # base offset, length, leader epoch, magic: then the CRC-32C
_CRC_FROM = 21  # the CRC covers the batch from its attributes on

try:
    from google_crc32c import value as _crc32c
except ImportError:  # the worker extra has it; without it aiokafka checks, more slowly
    _crc32c = None


class BatchRecord(Protocol):
    """A record of a batch as aiokafka's fetcher reads it to make a ``ConsumerRecord``:
    aiokafka's own (compiled, untyped) or a ``LenientRecord``."""

    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def timestamp_type(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]]: ...
    @property
    def checksum(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class LenientRecord:
    """One record as ``parse_batch`` reads it, with the attributes aiokafka's record has."""

    offset: int
    timestamp: int
    timestamp_type: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    checksum: int | None  # REPAIRED when a header name was not UTF-8, else None


class TolerantMemoryRecords:
    """aiokafka's ``MemoryRecords`` for one fetch response, re-reading batches that fail."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._inner = MemoryRecords(data)
        self._pos = 0  # where the batch the inner reader hands out next starts

    def size_in_bytes(self) -> int:
        return int(self._inner.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._inner.has_next())

    def next_batch(self) -> Any:
        batch = self._inner.next_batch()
        if batch is None:
            return None
        start = self._pos
        (length,) = struct.unpack_from(">i", self._data, start + 8)
        self._pos = start + _LOG_OVERHEAD + length
        if self._data[start + _MAGIC_AT] != 2:
            return batch  # v0/v1 message sets carry no headers, so nothing to fail on
        return _WatchedBatch(batch, memoryview(self._data)[start : self._pos])


class _WatchedBatch:
    """A v2 batch from aiokafka whose records fall back to ``parse_batch`` on an error."""

    def __init__(self, batch: Any, raw: memoryview) -> None:
        self._batch = batch
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        # base_offset, next_offset, validate_crc(), is_control_batch, producer_id, ...
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # control batches are read with next()
        return next(self._batch)

    def validate_crc(self) -> bool:
        """The batch's CRC-32C, checked with the CPU's instructions when google-crc32c is
        installed (about 25 GB/s; aiokafka's own C code does about 1.4, which for 150 KB
        images is a fifth of the event loop's time), else by aiokafka."""
        if _crc32c is None:
            return bool(self._batch.validate_crc())
        (expected,) = _CRC.unpack_from(self._raw, _CRC_AT)
        return bool(_crc32c(bytes(self._raw[_CRC_FROM:])) == expected)

    def __iter__(self) -> Iterator[BatchRecord]:
        # The whole batch at once: aiokafka's parser runs in C, and a list iterator costs
        # nothing per record, where a generator here would cost a frame switch each.
        try:
            return iter(list(self._batch))
        except Exception:  # any failure to parse: read the batch leniently, all of it
            return iter(parse_batch(self._raw))


def parse_batch(raw: bytes | memoryview) -> list[LenientRecord]:
    """Every record of one v2 record batch, header names decoded leniently.

    Raises ``ValueError`` when the batch itself is malformed (Kafka validates batches
    when they are written, so that means a corrupt fetch, which aiokafka's CRC check
    reports first).
    """
    try:
        return _parse(raw)
    except (struct.error, IndexError, ValueError) as exc:
        raise ValueError(f"malformed record batch: {exc}") from exc


def _parse(raw: bytes | memoryview) -> list[LenientRecord]:
    (
        base_offset,
        _length,
        _leader_epoch,
        magic,
        _crc,
        attributes,
        _last_offset_delta,
        base_timestamp,
        max_timestamp,
        _producer_id,
        _producer_epoch,
        _base_sequence,
        count,
    ) = _V2_HEADER.unpack_from(raw)
    if magic != 2:
        raise ValueError(f"record batch magic {magic}, expected 2")
    body: bytes | memoryview = memoryview(raw)[_V2_HEADER.size :]
    codec_id = attributes & 0x07
    if codec_id:
        decompress = _CODECS.get(codec_id)
        if decompress is None:
            raise ValueError(f"unknown compression codec {codec_id}")
        body = decompress(body)
    log_append_time = bool(attributes & _TIMESTAMP_TYPE_MASK)
    reader = _Reader(bytes(body))
    records = []
    for _ in range(count):
        size = reader.varint()
        end = reader.pos + size
        reader.pos += 1  # record attributes: unused in v2
        timestamp_delta = reader.varint()
        offset_delta = reader.varint()
        key = reader.blob()
        value = reader.blob()
        headers, repaired = [], False
        for _ in range(reader.varint()):
            raw_name = reader.blob() or b""
            try:
                name = raw_name.decode("utf-8")
            except UnicodeDecodeError:
                name, repaired = raw_name.decode("utf-8", "surrogateescape"), True
            headers.append((name, reader.blob()))
        if reader.pos != end:
            raise ValueError(f"record at offset delta {offset_delta} is not {size} bytes long")
        records.append(
            LenientRecord(
                offset=base_offset + offset_delta,
                timestamp=max_timestamp if log_append_time else base_timestamp + timestamp_delta,
                timestamp_type=int(log_append_time),
                key=key,
                value=value,
                headers=headers,
                checksum=REPAIRED if repaired else None,
            )
        )
    return records


class _Reader:
    """Zigzag varints and length-prefixed byte strings, as Kafka's record format v2 has."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (value >> 1) ^ -(value & 1)
            shift += 7
            if shift > 63:
                raise ValueError("varint longer than 10 bytes")

    def blob(self) -> bytes | None:
        size = self.varint()
        if size < 0:
            return None
        end = self.pos + size
        if end > len(self.data):
            raise ValueError(f"a field of {size} bytes runs past the end of its record")
        blob = self.data[self.pos : end]
        self.pos = end
        return blob


def install() -> None:
    """Make aiokafka's fetcher read fetch responses with ``TolerantMemoryRecords``.

    Process-wide and idempotent: every consumer of the process benefits, the SDK's
    readers included. Raises ``RuntimeError`` if aiokafka no longer reads them
    through ``aiokafka.consumer.fetcher.MemoryRecords``, so an upgrade that moves
    the hook fails at start-up rather than silently losing the protection.
    """
    current = getattr(_fetcher, "MemoryRecords", None)
    if current is TolerantMemoryRecords:
        return
    if current is not MemoryRecords:
        raise RuntimeError(
            "aiokafka.consumer.fetcher.MemoryRecords is not aiokafka's MemoryRecords; "
            "this aiokafka version reads fetches differently and the tolerant reader "
            "cannot be installed"
        )
    _fetcher.MemoryRecords = TolerantMemoryRecords
