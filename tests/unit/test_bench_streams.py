"""bench.gpu's camera streams: the records a stream producer sends (each stream's frames in
order, keyed by the stream) and the per-stream latency, order and bound it reports."""

from __future__ import annotations

from bench.gpu.corpus import make_corpus
from bench.gpu.streams import per_stream, stream_records
from schemas import Result, Status, decode_request
from schemas.result import Timings


def result(n: int, produced: int, published: float) -> Result:
    timings = Timings(
        produced_ms=produced, received_ms=produced, finished_ms=published, queue_ms=0.0,
        inference_ms=0.0, batch_size=1, published_ms=published,
    )  # fmt: skip
    return Result(
        id=f"cam-{n}", status=Status.ok, model="m", model_version="v", outputs=[],
        timings=timings, worker="w",
    )  # fmt: skip


def test_each_stream_is_keyed_by_itself_and_its_frames_come_in_order() -> None:
    records = stream_records(make_corpus(32, 24), "cam", streams=4, frames=3, mine=[1, 3])

    decoded = [decode_request(r.headers, r.key, r.value, 0) for r in records]
    assert [(d.meta.id, d.meta.stream, d.meta.seq) for d in decoded] == [
        ("cam-1", "cam-s1", 0), ("cam-3", "cam-s3", 0),
        ("cam-5", "cam-s1", 1), ("cam-7", "cam-s3", 1),
        ("cam-9", "cam-s1", 2), ("cam-11", "cam-s3", 2),
    ]  # fmt: skip
    assert [r.key for r in records[:2]] == [b"cam-s1", b"cam-s3"]


def test_the_worst_stream_and_the_bound_are_the_per_stream_p99s() -> None:
    # Two streams, frames 0..3 each, 33 ms apart; stream 1's frame 2 takes 250 ms and is
    # published after its frame 3.
    results = []
    for seq in range(4):
        due = 1_000 + 33 * seq
        results.append(result(2 * seq, due, due + 20))
        results.append(result(2 * seq + 1, due, due + (250 if seq == 2 else 30)))

    summary = per_stream(results, "cam", streams=2, bound_ms=100.0)

    assert summary["streams"] == 2
    assert summary["frames"] == 8
    assert summary["per_stream"]["s0"] == {
        "frames": 4, "p50_ms": 20.0, "p99_ms": 20.0, "out_of_order": 0
    }  # fmt: skip
    assert summary["worst_stream"] == "s1"
    assert summary["worst_p99_ms"] == 250.0
    assert summary["per_stream"]["s1"]["out_of_order"] == 1
    assert summary["out_of_order"] == 1
    assert summary["streams_over_bound"] == 1
    assert summary["within_bound"] is False
    assert per_stream(results, "cam", streams=2, bound_ms=300.0)["within_bound"] is True
