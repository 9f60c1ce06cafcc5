"""Headers of a dead-letter record: the original record plus why it failed.

A record goes to the dead-letter topic when it cannot get a result, above all
when it has no usable request id (so there is no Redis key to write). The
worker copies the record's key and value unchanged and uses these headers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from schemas.errors import ErrorCode

ERROR_CODE = "conveyor_error_code"
ERROR_MESSAGE = "conveyor_error_message"
ERROR_FIELD = "conveyor_error_field"
SOURCE_TOPIC = "conveyor_source_topic"
SOURCE_PARTITION = "conveyor_source_partition"
SOURCE_OFFSET = "conveyor_source_offset"
WORKER = "conveyor_worker"
UNREADABLE_NAMES = "conveyor_unreadable_header_names"
"""Hex of each original header name that was not UTF-8, comma-separated; in the copy
those names are decoded with U+FFFD replacement characters (as Java's client does)."""
ORIGINAL_SIZE = "conveyor_original_size"
"""Set when the copy's value was cut to fit the dead-letter topic: the original length."""
ORIGINAL_SHA256 = "conveyor_original_sha256"
"""Set with ``conveyor_original_size``: the hex SHA-256 of the original value."""
_DLQ_HEADERS = frozenset(
    {
        ERROR_CODE,
        ERROR_MESSAGE,
        ERROR_FIELD,
        SOURCE_TOPIC,
        SOURCE_PARTITION,
        SOURCE_OFFSET,
        WORKER,
        UNREADABLE_NAMES,
        ORIGINAL_SIZE,
        ORIGINAL_SHA256,
    }
)
# Enough for any message of ours; a header must stay well below the broker's record size.
MAX_MESSAGE_BYTES = 1024


def dlq_headers(
    original_headers: Sequence[tuple[str, bytes | None]],
    *,
    code: ErrorCode,
    message: str,
    field: str | None,
    source_topic: str,
    partition: int,
    offset: int,
    worker: str,
) -> list[tuple[str, bytes | None]]:
    """The original headers, in order, followed by the ``conveyor_*`` reason headers.

    Reason headers the record already had (it failed before, was replayed from
    the dead-letter topic and failed again) are replaced, so each appears once.
    ``conveyor_error_field`` is left out when ``field`` is None.
    """
    headers: list[tuple[str, bytes | None]] = []
    unreadable: list[str] = []
    for name, raw in original_headers:
        if name in _DLQ_HEADERS:
            continue
        if not name.isascii():
            original = name.encode("utf-8", "surrogateescape")
            readable = original.decode("utf-8", "replace")
            if readable != name:
                unreadable.append(original.hex())
                name = readable
        headers.append((name, raw))
    reason: list[tuple[str, bytes | None]] = [
        (ERROR_CODE, code.value.encode()),
        (ERROR_MESSAGE, _truncate(message)),
    ]
    if field is not None:
        reason.append((ERROR_FIELD, field.encode(errors="replace")))
    reason += [
        (SOURCE_TOPIC, source_topic.encode(errors="replace")),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
        (WORKER, worker.encode(errors="replace")),
    ]
    if unreadable:
        reason.append((UNREADABLE_NAMES, ",".join(unreadable).encode()))
    return headers + reason


def truncated(value: bytes, fits: int) -> tuple[bytes, list[tuple[str, bytes | None]]]:
    """The first ``fits`` bytes of a value too large for the dead-letter topic, and the
    headers that say what was cut: the original size and SHA-256."""
    digest = hashlib.sha256(value).hexdigest().encode()
    return value[: max(fits, 0)], [
        (ORIGINAL_SIZE, str(len(value)).encode()),
        (ORIGINAL_SHA256, digest),
    ]


def _truncate(message: str) -> bytes:
    raw = message.encode(errors="replace")
    if len(raw) <= MAX_MESSAGE_BYTES:
        return raw
    # Cut on a character boundary so the header stays valid UTF-8.
    return raw[: MAX_MESSAGE_BYTES - 3].decode(errors="ignore").encode() + "…".encode()
