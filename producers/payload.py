"""Turn what a caller passes (bytes or a file path) into a payload and its media type.

Images are recognised by their magic bytes, never by file name, so a renamed
file still gets the right ``content-type``; other payloads need an explicit one.
"""

from __future__ import annotations

from pathlib import Path

from producers.errors import InvalidInput
from schemas import ContentType, Limits

_NPY_MAGIC = b"\x93NUMPY"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"


def sniff_content_type(data: bytes) -> ContentType | None:
    """The media type that ``data``'s magic bytes announce (JPEG, PNG, WebP, npy), else None."""
    if data.startswith(_JPEG_MAGIC):
        return ContentType.JPEG
    if data.startswith(_PNG_MAGIC):
        return ContentType.PNG
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ContentType.WEBP
    if data.startswith(_NPY_MAGIC):
        return ContentType.NPY
    return None


def load_payload(
    payload: bytes | Path,
    content_type: ContentType | str | None,
    limits: Limits,
    max_bytes: int | None = None,
) -> tuple[bytes, ContentType | str]:
    """The payload bytes and media type; raises ``InvalidInput`` naming the file and limit.

    ``max_bytes`` (default ``limits.max_payload_bytes``) is the largest payload taken:
    larger when the client may send payloads by reference.
    """
    what = f"file {payload}" if isinstance(payload, Path) else "payload"
    limit = limits.max_payload_bytes if max_bytes is None else max_bytes
    data = _read(payload, limit) if isinstance(payload, Path) else payload
    if not isinstance(data, bytes):
        raise InvalidInput(f"a payload is bytes or a pathlib.Path, not {type(payload).__name__}")
    _check_size(what, len(data), limit)
    if content_type is not None:
        return data, content_type
    sniffed = sniff_content_type(data)
    if sniffed is None:
        raise InvalidInput(
            f"{what} is not a JPEG, PNG, WebP or .npy file (by its first bytes); "
            "give its content type (content_type=, or --content-type on the command line), "
            "e.g. application/json or text/plain"
        )
    return data, sniffed


def _read(path: Path, limit: int) -> bytes:
    try:
        # Checked before reading: a huge file is refused without loading it.
        _check_size(f"file {path}", path.stat().st_size, limit)
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read file {path}: {exc.strerror or exc}") from None


def _check_size(what: str, size: int, limit: int) -> None:
    if size == 0:
        raise InvalidInput(f"{what} is empty; a request needs payload bytes")
    if size > limit:
        raise InvalidInput(
            f"{what} is {size} bytes, more than the {limit} bytes a worker accepts "
            "(max_payload_bytes in a record, max_dataref_bytes by reference with "
            "dataref_store set): send a smaller payload"
        )
