"""Worker logging: text by default, JSON lines on request, request ids, no secrets."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime

import pytest

from workers.observe.logs import configure_logging

LOGGER = "conveyor.test"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Configure logging into a buffer; restore the root logger afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    kafka_level = logging.getLogger("aiokafka").level
    yield io.StringIO()
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(kafka_level)


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_fields(stream: io.StringIO) -> None:
    configure_logging("INFO", "json", stream=stream)
    logging.getLogger(LOGGER).info("batch of %d done", 32, extra={"partition": 3})
    [doc] = json_lines(stream)
    assert doc["level"] == "INFO"
    assert doc["logger"] == LOGGER
    assert doc["message"] == "batch of 32 done"
    assert doc["partition"] == 3
    assert "request_id" not in doc
    assert str(doc["ts"]).endswith("+00:00")  # UTC, whatever the host's zone
    datetime.fromisoformat(str(doc["ts"]))


def test_request_id_from_extra(stream: io.StringIO) -> None:
    configure_logging("INFO", "json", stream=stream)
    log = logging.getLogger(LOGGER)
    log.warning("bad input", extra={"request_id": "req-1"})
    log.warning("no request")
    ids = [doc.get("request_id") for doc in json_lines(stream)]
    assert ids == ["req-1", None]


def test_json_exception_is_one_line_with_the_traceback(stream: io.StringIO) -> None:
    configure_logging("INFO", "json", stream=stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger(LOGGER).exception("preprocess failed")
    [doc] = json_lines(stream)
    assert doc["message"] == "preprocess failed"
    assert "Traceback" in str(doc["exception"])
    assert "ValueError: boom" in str(doc["exception"])


def test_text_is_the_default(stream: io.StringIO) -> None:
    configure_logging("INFO", stream=stream)
    log = logging.getLogger(LOGGER)
    log.info("ready", extra={"request_id": "req-9"})
    try:
        raise KeyError("k")
    except KeyError:
        log.error("oops", exc_info=True)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(f"INFO {LOGGER}: ready [request_id=req-9]")
    assert lines[1].endswith(f"ERROR {LOGGER}: oops")
    assert lines[2] == "Traceback (most recent call last):"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_url_passwords_are_masked(stream: io.StringIO, fmt: str) -> None:
    configure_logging("INFO", fmt, stream=stream)  # type: ignore[arg-type]
    logging.getLogger(LOGGER).warning(
        "cannot reach %s", "rediss://worker:s3cret@redis:6380/0 and redis://:hunter2@x"
    )
    out = stream.getvalue()
    assert "s3cret" not in out
    assert "hunter2" not in out
    assert "rediss://worker:***@redis:6380/0" in out
    assert "redis://:***@x" in out


def test_level_and_chatty_libraries(stream: io.StringIO) -> None:
    configure_logging("WARNING", "text", stream=stream)
    logging.getLogger(LOGGER).info("hidden")
    logging.getLogger(LOGGER).warning("shown")
    assert stream.getvalue().count("\n") == 1
    configure_logging("DEBUG", "text", stream=stream)
    assert logging.getLogger("aiokafka").level == logging.WARNING  # connection chatter off


def test_reconfiguring_replaces_the_handler(stream: io.StringIO) -> None:
    other = io.StringIO()
    configure_logging("INFO", "text", stream=other)
    configure_logging("INFO", "json", stream=stream)
    logging.getLogger(LOGGER).info("once")
    assert other.getvalue() == ""
    assert len(json_lines(stream)) == 1


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="'text' or 'json'"):
        configure_logging("INFO", "xml")  # type: ignore[arg-type]
