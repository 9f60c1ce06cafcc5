"""Frame request ids: frame ``seq`` of stream ``s`` is request ``s:seq``."""

from __future__ import annotations

from producers.errors import InvalidInput
from producers.settings import ClientSettings
from schemas import is_valid_request_id

_SEQ_DIGITS = 19  # the longest ce_seq: 2**63 - 1


def frame_request_id(stream_id: str, seq: int) -> str:
    """The request id of frame ``seq`` of ``stream_id``: ``<stream id>:<seq>``."""
    return f"{stream_id}:{seq}"


def parse_frame_request_id(request_id: str) -> tuple[str, int] | None:
    """``(stream id, seq)`` of an id made by ``frame_request_id``, else None.

    The seq is what follows the last ``:``, so stream ids may contain ``:`` too.
    """
    stream_id, sep, seq = request_id.rpartition(":")
    if not sep or not stream_id or not seq.isascii() or not seq.isdigit():
        return None
    return stream_id, int(seq)


def check_stream_id(stream_id: str, settings: ClientSettings) -> None:
    """Raise ``InvalidInput`` unless every ``<stream_id>:<seq>`` is a valid request id."""
    longest = settings.limits.max_id_length - 1 - _SEQ_DIGITS
    if not is_valid_request_id(stream_id) or len(stream_id) > longest:
        raise InvalidInput(
            f"stream id {stream_id!r} must be 1–{longest} characters of [A-Za-z0-9._:-]: "
            f"frame request ids are <stream id>:<seq> and may be at most "
            f"{settings.limits.max_id_length} characters"
        )
