"""What goes wrong: bad records get error results and dead letters (sent where
``ce_replyto`` says), a failed device stops the worker, and a configuration error of a
publish ends it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schemas import ErrorCode, Status, decode_result
from tests.fakes import FakeRecord, FakeSource, GatedEcho, HeldSink
from tests.unit.pipeline.harness import make, records, run_until


@pytest.mark.parametrize(
    ("headers_change", "code"),
    [
        (lambda h: [x for x in h if x[0] != "ce_source"], ErrorCode.bad_request),
        (lambda h: [*h, ("ce_params", b"[1]")], ErrorCode.bad_request),
        (
            lambda h: [(n, b"image/gif" if n == "content-type" else v) for n, v in h],
            ErrorCode.unsupported_media_type,
        ),
    ],
)
async def test_bad_records_get_error_results_and_dead_letters(
    headers_change: Any, code: ErrorCode
) -> None:
    good = records(0, 3)
    bad = good[1]
    good[1] = FakeRecord(
        bad.topic, 0, bad.offset, 0, bad.key, bad.value, headers_change(list(bad.headers))
    )
    source = FakeSource({0: good})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    result = decode_result(sink.stored["p0-1"])
    assert result.error is not None
    assert result.error.code == code
    dead = [letter for box in sink.outboxes for letter in box.dead]
    assert len(dead) == 1
    assert dead[0].value == bad.value
    assert source.committed == {0: 3}


async def test_error_results_go_to_ce_replyto_with_a_checked_traceparent() -> None:
    good = records(0, 3)
    trace = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for n, traceparent in ((0, trace), (1, b"not-a-trace-context")):
        r = good[n]
        headers = [h for h in r.headers if h[0] != "ce_source"]  # a bad request
        headers += [("ce_replyto", b"my.replies"), ("traceparent", traceparent)]
        good[n] = FakeRecord(r.topic, 0, r.offset, 0, r.key, r.value, headers)
    source = FakeSource({0: good})
    pipeline, sink = make(source, GatedEcho())
    await run_until(pipeline, lambda: len(sink.stored) == 3)
    sent = {
        request_id: (reply_to, dict(headers))
        for box in sink.outboxes
        for request_id, reply_to, headers in zip(box.ids, box.reply_to, box.headers, strict=True)
    }
    assert sent["p0-0"][0] == "my.replies"
    assert sent["p0-0"][1]["traceparent"] == trace
    assert sent["p0-1"][0] == "my.replies"
    assert "traceparent" not in sent["p0-1"][1]  # malformed: dropped, as W3C says
    assert sent["p0-2"][0] is None


async def test_a_failed_device_stops_the_worker_with_its_batch_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poison's failure left the device broken: the worker stops (DeviceLost, exit
    status 7) instead of answering the batch, or any later one, with errors; the poison's
    offset is not committed, so another member serves it."""
    import workers.model.inference
    from workers.types import DeviceLost

    monkeypatch.setattr(
        workers.model.inference, "device_error", lambda device: RuntimeError("CUDA error: lost")
    )
    source = FakeSource({0: records(0, 40)})
    pipeline, sink = make(source, GatedEcho())
    with pytest.raises(DeviceLost, match="CUDA error: lost"):
        await asyncio.wait_for(pipeline.run(asyncio.Event()), 10)
    assert "p0-13" not in sink.stored
    assert all(sink.status(i) is Status.ok for i in sink.stored)
    assert source.committed.get(0, 0) <= 13


async def test_a_configuration_error_of_an_overlapping_publish_ends_the_worker() -> None:
    from workers.publish.errors import PublishConfigError

    held = HeldSink(fail_with=PublishConfigError("Redis refused this worker's writes"))
    pipeline, _ = make(FakeSource({0: records(0, 40)}), GatedEcho(), sink=held)
    held.release.set()
    with pytest.raises(PublishConfigError, match="refused"):  # itself, not in a group
        await asyncio.wait_for(pipeline.run(asyncio.Event()), 10)
