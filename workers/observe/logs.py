"""Logging for the worker process: readable lines by default, JSON lines for collectors.

``configure_logging("INFO", "json")`` makes every record one JSON object per line
with ``ts``, ``level``, ``logger``, ``message``, the ``request_id`` when there is one
(``extra={"request_id": ...}`` on the call), any other ``extra`` fields, and
``exception`` with the traceback. The text format shows the same request id as
``[request_id=...]``.

Secrets: credentials in URLs (``redis://user:password@host``) are masked in every
message as a last line of defence; the real rule is never to log settings
wholesale, only the fields an operator needs.
"""

from __future__ import annotations

import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson

__all__ = [
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "redact",
]

LogFormat = Literal["text", "json"]

# Libraries that log every connection step at INFO; their warnings still show.
_CHATTY = ("aiokafka", "kafka")
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@\s]*@")
# Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def redact(text: str) -> str:
    """Mask the password of every ``scheme://user:password@`` in ``text``."""
    return _URL_CREDENTIALS.sub(r"\g<scheme>\g<user>:***@", text)


def _request_id(record: logging.LogRecord) -> str | None:
    given = getattr(record, "request_id", None)
    return None if given is None else str(given)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message [request_id=...]``, traceback on the following lines."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = _request_id(record)
        if request_id is not None:
            first, newline, rest = line.partition("\n")
            line = f"{first} [request_id={request_id}]{newline}{rest}"
        return redact(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        request_id = _request_id(record)
        if request_id is not None:
            doc["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc and key != "request_id":
                doc[key] = value
        if record.exc_info:
            doc["exception"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            doc["stack"] = record.stack_info
        return orjson.dumps(doc, default=repr).decode()


def configure_logging(
    level: str | int = "INFO", fmt: LogFormat = "text", *, stream: TextIO | None = None
) -> None:
    """Send all logging to ``stream`` (stderr by default) in ``fmt``, at ``level``.

    Calling it again replaces what an earlier call installed, and leaves handlers
    installed by anything else alone.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("conveyor")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "conveyor"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    quiet = max(logging.WARNING, root.getEffectiveLevel())
    for name in _CHATTY:
        logging.getLogger(name).setLevel(quiet)
