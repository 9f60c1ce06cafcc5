"""Payload by reference (a claim check): what a ``ce_dataref`` header may name.

A request whose payload is too large for a Kafka record carries, instead of the
bytes, a reference to where they are stored, in the CloudEvents ``dataref``
extension attribute (header ``ce_dataref``), and an empty value. Two stores
are part of the contract:

- ``redis:<key>``: a string key in the Redis the worker writes results to (no
  host: a request can never make a worker connect somewhere else);
- ``s3://<bucket>/<key>``: an object in the S3-compatible store the worker is
  configured for.

Keys are percent-encoded (RFC 3986): characters outside
``A-Z a-z 0-9 - . _ ~ : @ ! $ & ' ( ) * + , ; = /`` are written ``%XX`` (UTF-8).
Keys the SDK writes (``conveyor:data:<request id>``, ``<prefix><request id>``)
need no encoding. ``ce_dataexpires`` (RFC 3339, optional) says when the stored
object stops being kept, so that a worker can tell an expired payload from a
missing one. Parsing here checks syntax only; which stores, prefixes and
buckets a worker reads is the worker's configuration.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal, NamedTuple
from urllib.parse import quote, unquote_to_bytes

__all__ = [
    "DEFAULT_DATA_PREFIX",
    "DataRef",
    "parse_dataref",
    "redis_dataref",
    "s3_dataref",
]

DEFAULT_DATA_PREFIX = "conveyor:data:"
"""Where the SDK stores payloads in Redis: ``conveyor:data:<request id>``."""

MAX_KEY_BYTES = 1024  # S3's limit on object keys; Redis keys of payloads get the same
_URI_CHARS = re.compile(r"[A-Za-z0-9\-._~:@!$&'()*+,;=/%]+")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")  # a % not followed by two hex digits
# S3's rules for bucket names (the path-style subset every S3-compatible store takes).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SAFE = ":@!$&'()*+,;=/~"  # kept as they are by quote(), beside letters, digits and -._

Store = Literal["redis", "s3"]


class DataRef(NamedTuple):
    """A parsed ``ce_dataref``: where a request's payload is stored."""

    uri: str
    """The header's value, as sent."""
    store: Store
    bucket: str
    """The S3 bucket; empty for Redis."""
    key: str
    """The Redis key or S3 object key, percent-decoded."""
    expires: datetime | None = None
    """``ce_dataexpires`` in UTC: when the stored object stops being kept, if said."""


def parse_dataref(uri: str) -> DataRef:
    """The reference in a ``ce_dataref`` value; raises ``ValueError`` saying what is wrong."""
    scheme, colon, rest = uri.partition(":")
    if not colon or _URI_CHARS.fullmatch(rest) is None or _PERCENT.search(rest):
        raise ValueError(_RULE)
    scheme = scheme.lower()  # RFC 3986: schemes are case-insensitive
    if scheme == "redis":
        return DataRef(uri, "redis", "", _key(rest))
    if scheme == "s3" and rest.startswith("//"):
        bucket, slash, key = rest[2:].partition("/")
        if _BUCKET.fullmatch(bucket) is None:
            raise ValueError(
                "an S3 bucket name is 3–63 characters of a-z 0-9 . - "
                "(starting and ending with a letter or digit)"
            )
        if not slash:
            raise ValueError(_RULE)
        return DataRef(uri, "s3", bucket, _key(key))
    raise ValueError(_RULE)


_RULE = (
    "must be redis:<key> or s3://<bucket>/<key>, the key percent-encoded (RFC 3986), "
    "e.g. redis:conveyor:data:id1"
)


def _key(encoded: str) -> str:
    raw = unquote_to_bytes(encoded)
    if not raw:
        raise ValueError("names an empty key; " + _RULE)
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"names a key of {len(raw)} bytes; at most {MAX_KEY_BYTES}")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ValueError("names a key that is not UTF-8 once percent-decoded") from None


def redis_dataref(key: str) -> str:
    """The ``ce_dataref`` value naming Redis key ``key``."""
    return "redis:" + quote(key, safe=_SAFE)


def s3_dataref(bucket: str, key: str) -> str:
    """The ``ce_dataref`` value naming object ``key`` of S3 bucket ``bucket``."""
    return f"s3://{bucket}/{quote(key, safe=_SAFE)}"
