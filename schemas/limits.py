"""Size limits a worker enforces on incoming records.

They bound what one record can make a worker allocate or parse, so a single
bad producer cannot exhaust memory or CPU. The defaults are the contract's
published values (docs/contract.md); a deployment may lower them.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

MiB = 1024 * 1024
# Room for the key (a request id), a dead letter's error headers and the record
# batch's own framing (about a hundred bytes): generous, so no valid request is refused.
_FRAMING_BYTES = 64 * 1024


class Limits(BaseModel, frozen=True, use_attribute_docstrings=True):
    """Limits on one request record; ``decode_request`` and ``encode_request`` check them."""

    max_id_length: int = Field(default=128, ge=1, le=128)
    """Longest request id (and ``ce_stream``), in characters. 128 is the contract's maximum."""
    max_header_value_bytes: int = Field(default=1024, ge=64)
    """Largest value of any contract header except ``ce_params``."""
    max_headers_total_bytes: int = Field(default=64 * 1024, ge=1024)
    """Largest sum of header names and values over all headers, unknown ones included."""
    max_params_bytes: int = Field(default=16 * 1024, ge=2)
    """Largest ``ce_params`` header value (UTF-8 JSON)."""
    max_params_depth: int = Field(default=8, ge=1)
    """Deepest nesting of objects and arrays in ``ce_params``; the top-level object is depth 1."""
    max_payload_bytes: int = Field(default=16 * MiB, ge=1)
    """Largest record value."""
    max_dataref_bytes: int = Field(default=256 * MiB, ge=1)
    """Largest payload stored by reference (``ce_dataref``). Workers check the stored
    object's size before they read it."""
    max_pixels: int = Field(default=40_000_000, ge=1)
    """Most pixels (width x height) of a decoded image. Workers check it while decoding,
    before allocating the image, so a small compressed "decompression bomb" is refused."""

    @property
    def max_record_bytes(self) -> int:
        """Largest Kafka record (batch) one valid request can need: the payload, every
        header, the key and Kafka's framing. A topic that carries requests, or copies
        of them as dead letters, needs ``max.message.bytes`` at least this large."""
        return self.max_payload_bytes + self.max_headers_total_bytes + _FRAMING_BYTES


DEFAULT_LIMITS = Limits()
