"""``conveyor compare``'s arithmetic: agreement by task, boxes by IoU, latency percentiles."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from producers.compare import compare, iou
from producers.version_commands import report
from schemas import Result, Timings, error_result, ok_result


def result(request_id: str, outputs: Any, version: str, inference_ms: float = 5.0) -> Result:
    timings = Timings(
        produced_ms=1000,
        received_ms=1010.0,
        batch_start_ms=1020.0,
        finished_ms=1030.0,
        queue_ms=10.0,
        inference_ms=inference_ms,
        batch_size=8,
        published_ms=1040.0,
    )
    return ok_result(
        request_id, outputs, model="m", model_version=version, worker="w", timings=timings
    )


def classes(*indices: int) -> list[dict[str, Any]]:
    return [{"label": str(i), "index": i, "score": 0.9 - 0.1 * n} for n, i in enumerate(indices)]


def detections(*boxes: tuple[int, tuple[float, float, float, float]]) -> dict[str, Any]:
    return {
        "type": "conveyor.detection.v1",
        "width": 100,
        "height": 100,
        "detections": [
            {"box": list(box), "score": 0.9, "index": index, "label": str(index)}
            for index, box in boxes
        ],
    }


def embedding(*values: float) -> dict[str, Any]:
    data = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return {
        "type": "conveyor.embedding.v1",
        "dtype": "float32",
        "shape": [len(values)],
        "normalized": False,
        "data": data,
    }


def test_classification_agrees_on_the_top_class() -> None:
    primary = {f"r{n}": result(f"r{n}", classes(n % 3, 7), "v1") for n in range(10)}
    shadow = {f"r{n}": result(f"r{n}", classes(n % 2, 7), "v2") for n in range(10)}
    found = compare(primary, shadow)
    same = sum(n % 3 == n % 2 for n in range(10))
    assert (found.joined, found.top1.compared, found.top1.agreed) == (10, 10, same)
    assert found.primary_versions == {"v1": 10}
    assert found.shadow_versions == {"v2": 10}


def test_boxes_match_within_a_class_by_iou() -> None:
    ours = detections((1, (0, 0, 10, 10)), (2, (50, 50, 60, 60)), (3, (0, 0, 5, 5)))
    theirs = detections((1, (1, 0, 11, 10)), (2, (80, 80, 90, 90)), (4, (0, 0, 5, 5)))
    found = compare({"a": result("a", ours, "v1")}, {"a": result("a", theirs, "v2")})
    boxes = found.boxes
    assert (boxes.primary, boxes.shadow, boxes.matched) == (3, 3, 1)  # class 4 is not class 3
    assert boxes.mean_iou == pytest.approx(90 / 110)
    assert boxes.f1 == pytest.approx(2 / 6)


def test_iou() -> None:
    assert iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert iou((0, 0, 10, 10), (10, 10, 20, 20)) == 0.0
    assert iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)


def test_embeddings_by_cosine() -> None:
    primary = {"a": result("a", embedding(1, 0, 0), "v1"), "b": result("b", embedding(1, 1), "v1")}
    shadow = {"a": result("a", embedding(0, 1, 0), "v2"), "b": result("b", embedding(2, 2), "v2")}
    found = compare(primary, shadow)
    assert sorted(found.cosine.values) == pytest.approx([0.0, 1.0])
    assert found.document()["embedding_cosine"]["min"] == pytest.approx(0.0)


def test_other_outputs_are_compared_whole_and_statuses_apart() -> None:
    failed = error_result("c", "model_error", "boom", model="m", model_version="v2", worker="w")
    primary = {i: result(i, {"echo": i}, "v1") for i in "abc"}
    shadow = {"a": result("a", {"echo": "a"}, "v2"), "b": result("b", {"echo": "x"}, "v2")}
    shadow["c"] = failed
    shadow["d"] = result("d", {"echo": "d"}, "v2")  # the primary's went elsewhere
    found = compare(primary, shadow)
    assert (found.joined, found.shadow_only) == (3, 1)
    assert (found.status.compared, found.status.agreed) == (3, 2)
    assert (found.identical.compared, found.identical.agreed) == (2, 1)  # ok pairs only


def test_latency_percentiles_per_side_and_the_report() -> None:
    primary = {f"r{n}": result(f"r{n}", classes(1), "v1", inference_ms=n) for n in range(1, 101)}
    shadow = {f"r{n}": result(f"r{n}", classes(1), "v2", inference_ms=2 * n) for n in range(1, 101)}
    found = compare(primary, shadow)
    latency = found.document()["latency_ms"]
    assert latency["primary"]["inference"] == {"p50": 50, "p90": 90, "p99": 99}
    assert latency["shadow"]["inference"] == {"p50": 100, "p90": 180, "p99": 198}
    assert latency["shadow"]["end_to_end"]["p50"] == 40.0  # published - produced
    text = report(found, "m", "conveyor.m.results", "conveyor.m.shadow-results")
    assert "m: 100 requests answered by both" in text
    assert "top-1 class agrees: 100 of 100 (100.00%)" in text
    assert "v2 (100)" in text
