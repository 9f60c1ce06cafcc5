"""Error codes of the wire contract and the one exception that decoding raises.

Every error a caller can see in a result (``error.code``) is an ``ErrorCode``;
every record or result that breaks the contract raises ``ContractError`` with
the field at fault, so the worker can turn it into an error result or a
dead-letter record without parsing messages.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

# How much of an offending value an error message may quote: enough to
# recognise it, never so much that a 16 MiB payload ends up in a log line.
_MAX_SHOWN = 64


class ErrorCode(StrEnum):
    """Why a request did not get an ``ok`` result (``error.code`` in a result)."""

    bad_request = "bad_request"
    """The record breaks the contract: a required header is missing, duplicated,
    not UTF-8 or malformed, or the value is empty or a tombstone."""
    unsupported_type = "unsupported_type"
    """``ce_specversion`` is not ``1.0`` or ``ce_type`` is not ``conveyor.request.v1``
    (e.g. a newer producer talking to an older worker)."""
    unsupported_media_type = "unsupported_media_type"
    """``content-type`` is not one of the media types of the contract."""
    payload_too_large = "payload_too_large"
    """The record value is larger than the worker's ``max_payload_bytes``."""
    image_too_large = "image_too_large"
    """The image decodes to more pixels than the worker's ``max_pixels``."""
    text_too_long = "text_too_long"
    """The text has more tokens than the model's ``max_length``, and the worker refuses
    such texts (``--truncation refuse``) rather than cutting them."""
    decode_failed = "decode_failed"
    """The payload (or a result document) could not be decoded: a corrupt image,
    malformed JSON or NumPy data, or a tensor of the wrong shape for the model."""
    bad_feature = "bad_feature"
    """A feature record does not fit the model's feature schema: an unknown (misspelt)
    feature, a required one missing, or a value of the wrong type (a category outside its
    values included); ``field`` names the feature (``features.<name>``)."""
    expired = "expired"
    """``ce_deadline`` passed before the model ran."""
    superseded = "superseded"
    """Freshest-frame mode: a newer frame of the same ``ce_stream`` was already waiting,
    so this older one was answered without running the model."""
    model_error = "model_error"
    """The model raised on this item (after the batch was split to isolate it)."""
    out_of_memory = "out_of_memory"
    """The item did not fit in accelerator memory even in a batch of one."""
    dataref_missing = "dataref_missing"
    """The object that ``ce_dataref`` names does not exist: it was never stored, the
    name is wrong, or it was deleted (before its ``ce_dataexpires``, when that is set)."""
    dataref_expired = "dataref_expired"
    """The object that ``ce_dataref`` names is gone and its ``ce_dataexpires`` has
    passed: the request waited in its topic longer than its payload was kept."""
    dataref_too_large = "dataref_too_large"
    """The object that ``ce_dataref`` names is larger than the worker's
    ``max_dataref_bytes``."""
    dataref_denied = "dataref_denied"
    """The worker may not read the object that ``ce_dataref`` names: its store, key
    prefix or bucket is not one this worker reads from, or the store refused access."""
    cancelled = "cancelled"
    """The request was cancelled (``conveyor:cancel:{<id>}`` set) before its batch ran;
    the model never saw it."""
    result_too_large = "result_too_large"
    """The model's answer was larger than the reply topic accepts (its
    ``max.message.bytes``); the message gives both sizes. Raise the topic's limit or
    ask for less (e.g. a smaller ``top_k``)."""
    prompt_too_long = "prompt_too_long"
    """A generation model's prompt has more tokens than the model takes; the message
    gives both numbers. Sending it again fails the same way: shorten the prompt."""
    internal = "internal"
    """A bug or an unexpected failure in the worker itself."""


class ContractError(ValueError):
    """A record or result document that breaks the wire contract.

    ``str(err)`` is a sentence for the user who produced the record: it names
    the field, the limit and the value seen (quoted safely and truncated).
    ``request_id`` is the record's id when it had a usable one, so the worker
    can still write an error result for it; records without one can only go to
    the dead-letter topic.
    """

    retriable: ClassVar[bool] = False
    """Sending the same record again fails the same way."""

    code: ErrorCode
    field: str
    message: str
    limit: object | None
    seen: object | None
    request_id: str | None

    def __init__(
        self,
        code: ErrorCode,
        field: str,
        message: str,
        *,
        limit: object | None = None,
        seen: object | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(code, field, message)
        self.code = code
        self.field = field
        self.message = message
        self.limit = limit
        self.seen = seen
        self.request_id = request_id

    def __str__(self) -> str:
        details = []
        if self.limit is not None:
            details.append(f"limit {self.limit}")
        if self.seen is not None:
            details.append(f"got {_show(self.seen)}")
        text = f"{self.field}: {self.message}"
        return f"{text} ({', '.join(details)})" if details else text

    def __repr__(self) -> str:
        return f"ContractError({self.code.value}, {str(self)!r}, request_id={self.request_id!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments do not survive the default exception pickling,
        # and errors do cross process pools (decoding may run in one).
        state = (self.code, self.field, self.message, self.limit, self.seen, self.request_id)
        return (_rebuild, state)


def _rebuild(
    code: ErrorCode,
    field: str,
    message: str,
    limit: object | None,
    seen: object | None,
    request_id: str | None,
) -> ContractError:
    return ContractError(code, field, message, limit=limit, seen=seen, request_id=request_id)


def _show(value: object) -> str:
    """Quote a value seen in a record: escaped (no control characters) and truncated."""
    if isinstance(value, bool | int | float):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        shown = repr(bytes(value[:_MAX_SHOWN]))
        return shown if len(value) <= _MAX_SHOWN else f"{shown}… ({len(value)} bytes)"
    text = value if isinstance(value, str) else str(value)
    shown = repr(text[:_MAX_SHOWN])
    return shown if len(text) <= _MAX_SHOWN else f"{shown}… ({len(text)} characters)"
